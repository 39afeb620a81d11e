use super::*;

fn file(name: &str, body: &str) -> EntryFile {
    EntryFile {
        file_name: name.to_string(),
        counter: split_counter(name).and_then(|(_, c)| c),
        entry: BootEntry::parse(body),
    }
}

fn chrysalis(name: &str, generation: u64) -> EntryFile {
    let slot = EntryName::parse(name).expect("chrysalis name").slot;
    file(name, &BootEntry::for_slot(slot, "v", generation, "x=1").render())
}

#[test]
fn names_round_trip() {
    for (name, slot, counter) in [
        ("chrysalis-a.conf", Slot::A, None),
        ("chrysalis-b+1.conf", Slot::B, Some(Counter { left: 1, done: 0 })),
        ("chrysalis-b+0-1.conf", Slot::B, Some(Counter { left: 0, done: 1 })),
        ("chrysalis-a+3-12.conf", Slot::A, Some(Counter { left: 3, done: 12 })),
    ] {
        let parsed = EntryName::parse(name).expect(name);
        assert_eq!(parsed, EntryName { slot, counter }, "{name}");
        assert_eq!(parsed.file_name(), name);
    }
    assert_eq!(EntryName::armed(Slot::B).file_name(), "chrysalis-b+1.conf");
    assert!(EntryName::parse("chrysalis-b+0-1.conf").expect("bad").is_bad());
    assert!(EntryName::parse("chrysalis-b+1.conf").expect("armed").is_armed());
    assert!(EntryName::parse("chrysalis-c.conf").is_none());
    assert!(EntryName::parse("chrysalis-a.conf.tmp").is_none());
    assert!(EntryName::parse("debian.conf").is_none());
    assert_eq!(split_counter("x+abc.conf"), Some(("x+abc", None)));
    assert_eq!(split_counter("x+1-.conf"), Some(("x+1-", None)));
    assert_eq!(split_counter("X.CONF"), Some(("X", None)));
    assert_eq!(split_counter("x.efi"), None);
}

#[test]
fn body_round_trips() {
    let e = BootEntry::for_slot(Slot::B, "0.2.0", 7, "dm-mod.create=\"a b\" chrysalis.version=0.2.0 panic=10");
    let text = e.render();
    assert_eq!(
        text,
        "title Chrysalis 0.2.0 (slot b)\nsort-key chrysalis\nversion 7\nlinux /chrysalis/b/vmlinuz\n\
         options dm-mod.create=\"a b\" chrysalis.version=0.2.0 panic=10\n"
    );
    let back = BootEntry::parse(&text);
    assert_eq!(back, e);
    assert_eq!(back.generation(), Some(7));
    assert_eq!(back.chrysalis_version().as_deref(), Some("0.2.0"));
    let multi = BootEntry::parse("# c\ntitle  \"Quoted\"\noptions a=1\noptions\tb=2\nfoo bar\n");
    assert_eq!(multi.title.as_deref(), Some("Quoted"));
    assert_eq!(multi.options, "a=1 b=2");
    assert_eq!(multi.other, vec![("foo".to_string(), "bar".to_string())]);
}

#[test]
fn strverscmp_matches_systemd() {
    use Ordering::*;
    let c = |a: &str, b: &str| strverscmp_improved(Some(a), Some(b));
    // Expected orders follow the semantics documented in systemd's string-util-fundamental.c.
    let newer = [
        ("1", "0"),
        ("10", "9"),
        ("1.1", "1"),
        ("1.10", "1.9"),
        ("123", "00122"),
        ("1.0.1", "1.0~rc1"),
        ("1", "1~"),
        ("1.0", "1-0"),
        ("1_1", "1_0"),
        ("1a", "1"),
        ("1", "a"),
        ("2", "1.9"),
        ("1^1", "1"),
        ("1.1", "1^1"),
        ("5.10", "5.9.1"),
        ("1.2", "1..2"),
    ];
    for (a, b) in newer {
        assert_eq!(c(a, b), Greater, "{a} > {b}");
        assert_eq!(c(b, a), Less, "{b} < {a}");
    }
    for (a, b) in [("1", "1"), ("007", "7"), ("1.0", "1.0"), ("a~b", "a~b"), ("v1.0", "v1.0")] {
        assert_eq!(c(a, b), Equal, "{a} == {b}");
    }
    assert_eq!(strverscmp_improved(None, Some("1")), Less);
    assert_eq!(strverscmp_improved(Some(""), Some("1")), Less);
    assert_eq!(strverscmp_improved(None, None), Equal);
}

#[test]
fn boot_order_prefers_highest_good_generation() {
    // Fresh image.
    assert_eq!(boot_order(&[chrysalis("chrysalis-a.conf", 1)]), ["chrysalis-a.conf"]);
    // Armed trial of B (generation 2) beats committed A (1).
    let armed = [chrysalis("chrysalis-a.conf", 1), chrysalis("chrysalis-b+1.conf", 2)];
    assert_eq!(boot_order(&armed)[0], "chrysalis-b+1.conf");
    // The trial in progress / failed (0 tries left) sorts last: A boots.
    let failed = [chrysalis("chrysalis-b+0-1.conf", 2), chrysalis("chrysalis-a.conf", 1)];
    assert_eq!(boot_order(&failed), ["chrysalis-a.conf", "chrysalis-b+0-1.conf"]);
    // Committed B (2) beats A (1); a rollback rewrites A as generation 3.
    assert_eq!(
        boot_order(&[chrysalis("chrysalis-a.conf", 1), chrysalis("chrysalis-b.conf", 2)])[0],
        "chrysalis-b.conf"
    );
    assert_eq!(
        boot_order(&[chrysalis("chrysalis-a.conf", 3), chrysalis("chrysalis-b.conf", 2)])[0],
        "chrysalis-a.conf"
    );
    // Generations compare as numbers, not strings.
    assert_eq!(
        boot_order(&[chrysalis("chrysalis-a.conf", 9), chrysalis("chrysalis-b.conf", 10)])[0],
        "chrysalis-b.conf"
    );
    // Entries without a sort-key come after ours, whatever their name or version.
    let foreign = file("zzz.conf", "title Other\nversion 99\nlinux /vmlinuz\n");
    assert_eq!(boot_order(&[foreign.clone(), chrysalis("chrysalis-a.conf", 1)])[0], "chrysalis-a.conf");
    // Only bad entries: they still boot, in sort order.
    let all_bad = [chrysalis("chrysalis-a+0-3.conf", 1), chrysalis("chrysalis-b+0-1.conf", 2)];
    assert_eq!(boot_order(&all_bad)[0], "chrysalis-b+0-1.conf");
    // Same version: id descending, then more tries left first.
    let twins = [file("x+1-1.conf", "sort-key s\nversion 1\n"), file("x+2.conf", "sort-key s\nversion 1\n")];
    assert_eq!(boot_order(&twins)[0], "x+2.conf");
    let same_id = [
        EntryFile {
            file_name: "y.conf".into(),
            counter: Some(Counter { left: 1, done: 2 }),
            entry: BootEntry::default(),
        },
        EntryFile {
            file_name: "y.conf".into(),
            counter: Some(Counter { left: 3, done: 0 }),
            entry: BootEntry::default(),
        },
    ];
    assert_eq!(compare_entries(&same_id[1], &same_id[0]), Ordering::Less);
}

#[test]
fn esp_operations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let esp = Esp::new(dir.path());
    assert!(esp.list().expect("empty").is_empty());
    let a = BootEntry::for_slot(Slot::A, "0.1.0", 1, "chrysalis.slot=a");
    esp.write(&EntryName::plain(Slot::A), &a).expect("write a");
    esp.write(&EntryName::armed(Slot::B), &BootEntry::for_slot(Slot::B, "0.2.0", 2, "chrysalis.slot=b"))
        .expect("write b");
    fs::write(esp.entries_dir().join("chrysalis-b+0-1.conf.tmp"), "junk").expect("tmp");
    fs::write(esp.entries_dir().join(".chrysalis-b+0-1.conf.0a1b2c.tmp"), "junk").expect("tmp");
    fs::write(esp.entries_dir().join(".hidden.conf"), "title x\nlinux /x\n").expect("hidden");
    let entries = esp.slot_entries().expect("list");
    assert_eq!(entries.len(), 2);
    assert_eq!(mine(&entries, Slot::A, Some(1)).map(|e| e.file_name.as_str()), Some("chrysalis-a.conf"));
    assert_eq!(next_generation(&entries, Some(1)), 3);
    assert_eq!(next_generation(&entries, Some(9)), 10);
    // Kernels missing: systemd-boot would skip both entries.
    assert!(esp.boot_order().expect("order").is_empty());
    for slot in Slot::ALL {
        fs::create_dir_all(esp.kernel_path(slot).parent().expect("dir")).expect("mkdir");
        fs::write(esp.kernel_path(slot), "k").expect("kernel");
    }
    assert_eq!(esp.boot_order().expect("order"), ["chrysalis-b+1.conf", "chrysalis-a.conf"]);
    // What systemd-boot does before booting the armed entry.
    esp.rename("chrysalis-b+1.conf", &EntryName { slot: Slot::B, counter: Some(Counter { left: 0, done: 1 }) })
        .expect("rename");
    assert_eq!(esp.boot_order().expect("order"), ["chrysalis-a.conf", "chrysalis-b+0-1.conf"]);
    let mut removed = esp.remove_slot(Slot::B).expect("remove b");
    removed.sort();
    assert_eq!(removed, [".chrysalis-b+0-1.conf.0a1b2c.tmp", "chrysalis-b+0-1.conf", "chrysalis-b+0-1.conf.tmp"]);
    let names: Vec<String> = esp.list().expect("list").into_iter().map(|f| f.file_name).collect();
    assert_eq!(names, ["chrysalis-a.conf"]);
}
