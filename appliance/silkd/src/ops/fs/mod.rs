//! Filesystem ops: `fs_*`, `fs_push`/`fs_pull` (tar), `fs_find`, `fs_replace`, `fs_watch`.
