//! QEMU `-M microvm` driver over QMP.
