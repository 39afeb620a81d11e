//! End to end under QEMU: real microVMs booted from our images, driven through silkd.
//!
//! Enabled by `--features e2e` (`cargo xtask test` builds the images first). Each test
//! boots its own VMs in its own state directory and checks that no QEMU process is left
//! behind.
#![cfg(feature = "e2e")]

use anyhow::{bail, Context, Result};
use rand::RngCore;
use silkd_client::ExecOptions;
use std::io::Read;
use std::time::Duration;
use test_infra::{agent, assert_jailed, boot, catalog, init_tracing, qemu, qemu_processes_under, state_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vmm::{AfterSnapshot, SizeClass, VmId};
use wire::{Bytes64, Request, Response};

async fn exec_ok(conn: &mut silkd_client::AgentConn<vmm::AgentStream>, argv: &[&str]) -> Result<String> {
    let out = conn.exec(argv, ExecOptions::default(), b"").await?;
    if out.code != 0 {
        bail!("{argv:?} exited {}: {}", out.code, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_boot_exec_files_pull_snapshot_clone_shutdown() -> Result<()> {
    init_tracing();
    let state = state_dir()?;
    let driver = qemu(state.path())?;
    let catalog = catalog()?;
    let parent = boot(&driver, &catalog, "base", SizeClass::Small).await?;
    eprintln!("base ready after {:?} ({:?})", parent.ready_after, parent.vm.accel);
    let vm = parent.vm;
    assert_jailed(&vm)?;

    // The 10 MiB read-back below is past the default 8 MiB output cap.
    let mut conn = agent(&driver, &vm).await?.with_output_cap(16 << 20);
    assert!(matches!(conn.info().await?, Response::Info { proto: 2, .. }));
    assert_eq!(exec_ok(&mut conn, &["echo", "hello"]).await?, "hello\n");

    // stdin round trip of 3 MiB of random bytes, on the same kept connection.
    let mut input = vec![0u8; 3 * 1024 * 1024];
    rand::rng().fill_bytes(&mut input);
    let out = conn.exec(&["cat"], ExecOptions::default(), &input).await?;
    assert_eq!(out.code, 0);
    assert!(out.stdout == input, "cat echoed {} bytes, sent {}", out.stdout.len(), input.len());

    // Write and read back a 10 MiB file.
    let mut file = vec![0u8; 10 * 1024 * 1024];
    rand::rng().fill_bytes(&mut file);
    conn.write_file("/tmp/big.bin", &file, None).await?;
    let back = conn.download(&Request::FsRead { path: "/tmp/big.bin".into() }).await?;
    assert!(back == file, "read back {} bytes, wrote {}", back.len(), file.len());

    // fs_pull a directory as tar.
    exec_ok(
        &mut conn,
        &["sh", "-c", "mkdir -p /srv/tree/sub && echo one > /srv/tree/a.txt && echo two > /srv/tree/sub/b.txt"],
    )
    .await?;
    let tarball = conn.download(&Request::FsPull { path: "/srv/tree".into() }).await?;
    let mut archive = tar::Archive::new(&tarball[..]);
    let mut seen = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        let mut body = String::new();
        if entry.header().entry_type().is_file() {
            entry.read_to_string(&mut body)?;
            seen.push((path, body));
        }
    }
    seen.sort();
    let names: Vec<_> = seen.iter().map(|(p, b)| (p.trim_start_matches("./").to_string(), b.clone())).collect();
    assert!(names.iter().any(|(p, b)| p.ends_with("a.txt") && b == "one\n"), "tar holds a.txt: {names:?}");
    assert!(names.iter().any(|(p, b)| p.ends_with("sub/b.txt") && b == "two\n"), "tar holds sub/b.txt: {names:?}");

    // Snapshot → clone: the clone answers and sees the parent's files.
    exec_ok(&mut conn, &["sh", "-c", "echo from-parent > /root/marker"]).await?;
    drop(conn);
    let snap_dir = state.path().join("snap-base");
    let snapshot = driver.snapshot(&vm, &snap_dir, AfterSnapshot::Resumed).await.context("snapshot")?;
    let clone = driver.restore(&snapshot, &VmId::generate("clone")).await.context("restore")?;
    driver.wait_agent(&clone, Duration::from_secs(60)).await.context("clone agent")?;
    assert_jailed(&clone)?;
    let mut cconn = agent(&driver, &clone).await?;
    assert_eq!(exec_ok(&mut cconn, &["cat", "/root/marker"]).await?, "from-parent\n");
    // The clone is its own VM: a write there does not reach the parent.
    exec_ok(&mut cconn, &["sh", "-c", "echo from-clone > /root/marker"]).await?;
    let mut conn = agent(&driver, &vm).await?;
    assert_eq!(exec_ok(&mut conn, &["cat", "/root/marker"]).await?, "from-parent\n");
    drop((conn, cconn));

    // The driver's process "restarts": both QEMUs run on (their own session), and a new
    // driver re-attaches (QMP, console, agent bridge) from the records.
    drop(driver);
    let driver = qemu(state.path())?;
    for v in [&vm, &clone] {
        let again = driver.attach(&v.id).await.context("re-attach")?;
        assert_eq!(&again, v);
        assert_jailed(&again)?;
    }
    let mut conn = agent(&driver, &vm).await?;
    assert_eq!(exec_ok(&mut conn, &["cat", "/root/marker"]).await?, "from-parent\n");
    drop(conn);

    // Shutdown leaves no QEMU process behind.
    driver.shutdown(&clone, Duration::from_secs(10)).await?;
    driver.shutdown(&vm, Duration::from_secs(10)).await?;
    assert!(driver.list().await?.is_empty(), "no VM listed after shutdown");
    let left = qemu_processes_under(state.path());
    assert!(left.is_empty(), "QEMU processes left behind: {left:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rt_boot_overlay_python_port_forward_shutdown() -> Result<()> {
    init_tracing();
    let state = state_dir()?;
    let driver = qemu(state.path())?;
    let catalog = catalog()?;
    // The seed's template name resolves to our local rt build.
    let booted = boot(&driver, &catalog, "ghcr.io/cocoonstack/sandbox/rt:24.04", SizeClass::Small).await?;
    eprintln!("rt ready after {:?} ({:?})", booted.ready_after, booted.vm.accel);
    let vm = booted.vm;
    let mut conn = agent(&driver, &vm).await?;
    assert_eq!(exec_ok(&mut conn, &["echo", "hello"]).await?, "hello\n");
    assert_eq!(exec_ok(&mut conn, &["python3", "-c", "print(40+2)"]).await?, "42\n");
    for tool in ["bash", "git", "curl", "nc"] {
        exec_ok(&mut conn, &["sh", "-c", &format!("command -v {tool}")])
            .await
            .with_context(|| format!("{tool} in rt"))?;
    }
    // The root is a writable overlay over the read-only image.
    exec_ok(&mut conn, &["sh", "-c", "echo written > /usr/local/overlay-check && cat /usr/local/overlay-check"])
        .await?;

    // port_forward to a listener in the guest.
    let server = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
s.bind(('127.0.0.1', 7000))\ns.listen()\nc, _ = s.accept()\nd = c.recv(100)\nc.sendall(d.upper())\nc.close()\n";
    conn.exec_detached(&["python3", "-c", server], ExecOptions::default()).await?;
    let mut forwarded = None;
    for _ in 0..100 {
        let mut pconn = agent(&driver, &vm).await?;
        pconn.send(&Request::PortForward { port: 7000 }).await?;
        match pconn.recv_frame().await? {
            Response::Ready => {
                forwarded = Some(pconn);
                break;
            }
            Response::Error { .. } => tokio::time::sleep(Duration::from_millis(200)).await,
            other => bail!("port_forward answered {other:?}"),
        }
    }
    let mut pconn = forwarded.context("the guest listener never came up")?;
    pconn.send(&Request::Data { data: Bytes64(b"ping".to_vec()) }).await?;
    pconn.send(&Request::DataEnd).await?;
    let mut got = Vec::new();
    loop {
        match pconn.recv().await? {
            Response::Data { data } => got.extend_from_slice(&data.0),
            Response::Done => break,
            other => bail!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, b"PING");

    // The raw hybrid-vsock socket also works for an outside caller.
    let mut raw = vmm::agent::dial(&vm.vsock_socket, vmm::AGENT_PORT).await?;
    raw.write_all(b"{\"v\":1,\"op\":\"info\"}\n").await?;
    let mut buf = [0u8; 256];
    let n = raw.read(&mut buf).await?;
    assert!(buf[..n].starts_with(b"{\"type\":\"info\""), "raw info reply: {:?}", String::from_utf8_lossy(&buf[..n]));

    driver.shutdown(&vm, Duration::from_secs(10)).await?;
    let left = qemu_processes_under(state.path());
    assert!(left.is_empty(), "QEMU processes left behind: {left:?}");
    Ok(())
}

/// Bytes of console log on disk for `log` (both segments).
fn console_on_disk(log: &std::path::Path) -> u64 {
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    size(log) + size(&vmm::console::rotated_path(log))
}

/// Runs `line` through `sh -c` in the guest until the console log ends with `marker`
/// (output written while no host listens is dropped, so a write may need repeating).
async fn console_until(
    conn: &mut silkd_client::AgentConn<vmm::AgentStream>,
    log: &std::path::Path,
    line: &str,
    marker: &str,
) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        exec_ok(conn, &["sh", "-c", line]).await?;
        for _ in 0..10 {
            if vmm::console::tail_string(log, 4096).contains(marker) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if std::time::Instant::now() > deadline {
            bail!("{marker:?} never reached the console; tail:\n{}", vmm::console::tail_text(log, 20));
        }
    }
}

/// A guest writing far more than the cap to its serial console leaves at most the cap on disk
/// and the newest output in the log; after a restart of the host side (a fresh driver that
/// re-attaches), QEMU re-dials the console and the log continues, still capped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_flooding_its_serial_console_is_held_to_the_cap() -> Result<()> {
    init_tracing();
    let state = state_dir()?;
    let cap = 64 * 1024;
    let driver_for = |state: &std::path::Path| -> std::sync::Arc<dyn vmm::Driver> {
        let mut cfg = vmm::qemu::QemuConfig::from_env();
        cfg.state_dir = state.to_path_buf();
        cfg.console_cap = cap;
        std::sync::Arc::new(vmm::qemu::QemuDriver::new(cfg))
    };
    let driver = driver_for(state.path());
    let vm = boot(&driver, &catalog()?, "base", SizeClass::Small).await?.vm;
    let log = vm.console_log.clone();
    assert!(vmm::console::tail_string(&log, 1 << 20).contains("Linux version"), "boot output is kept from the start");
    let mut conn = agent(&driver, &vm).await?;
    // 2 MiB through the UART: 32 times the cap.
    let flood = "head -c 2097152 /dev/zero | tr '\\000' x > /dev/ttyS0; echo flood-done-1 > /dev/ttyS0";
    let t0 = std::time::Instant::now();
    console_until(&mut conn, &log, flood, "flood-done-1").await?;
    eprintln!("2 MiB through the serial console in {:?}", t0.elapsed());
    assert!(console_on_disk(&log) <= cap, "{} bytes on disk, cap {cap}", console_on_disk(&log));
    let tail = vmm::console::tail(&log, cap as usize)?;
    // Half the cap on disk, less the lines' stamps (31 bytes per 16 KiB of an unbroken line).
    assert!(tail.len() as u64 >= cap / 2 - 1024, "about half the cap is kept: {}", tail.len());
    assert!(tail.ends_with(b"flood-done-1\r\n") || tail.ends_with(b"flood-done-1\n"), "the newest bytes are kept");
    drop(conn);

    // "sandboxd restarted": the old driver (and its console listener) is gone; a new one
    // re-attaches and QEMU re-dials the console socket within a second.
    drop(driver);
    let driver = driver_for(state.path());
    let vm = driver.attach(&vm.id).await?;
    let mut conn = agent(&driver, &vm).await?;
    console_until(&mut conn, &log, "echo after-restart > /dev/ttyS0", "after-restart").await?;
    console_until(&mut conn, &log, flood.replace("done-1", "done-2").as_str(), "flood-done-2").await?;
    assert!(console_on_disk(&log) <= cap, "{} bytes on disk after the restart", console_on_disk(&log));
    drop(conn);
    driver.kill(&vm).await?;
    let left = qemu_processes_under(state.path());
    assert!(left.is_empty(), "QEMU processes left behind: {left:?}");
    Ok(())
}

/// KiB of the golden RAM map of a clone (`/memfd:chrysalis-golden-ram`) that other processes
/// map too (`Shared_Clean` + `Shared_Dirty` in `smaps`).
fn golden_ram_shared_kib(pid: u32) -> Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut inside = false;
    let mut shared = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line.contains("/memfd:chrysalis-golden-ram");
        } else if inside {
            if let Some(v) = line.strip_prefix("Shared_Clean:").or_else(|| line.strip_prefix("Shared_Dirty:")) {
                shared += v.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok(shared)
}

/// A golden booted with its RAM in a file (`Ram::SharedFile`) snapshots without streaming
/// its RAM; its clones map a sealed copy of that file privately: they start from the golden's
/// memory, diverge on their own pages, share the rest (PSS below RSS), and never change the
/// golden's file. A full snapshot of such a clone restores too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_share_the_golden_ram_copy_on_write() -> Result<()> {
    init_tracing();
    let state = state_dir()?;
    let driver = qemu(state.path())?;
    let mut spec = vmm::BootSpec::from_template(&catalog()?, "base", SizeClass::Small)?;
    spec.ram = vmm::Ram::SharedFile;
    let golden = driver.boot(&spec).await?;
    driver.wait_agent(&golden, Duration::from_secs(180)).await.context("golden agent")?;
    assert_jailed(&golden)?;
    let mut conn = agent(&driver, &golden).await?;
    exec_ok(&mut conn, &["sh", "-c", "echo golden > /dev/shm/marker"]).await?;
    drop(conn);
    let snap_dir = state.path().join("golden");
    let snap = driver.snapshot(&golden, &snap_dir, AfterSnapshot::Paused).await.context("snapshot")?;
    driver.kill(&golden).await?;
    let memory = snap_dir.join("memory");
    let meta = std::fs::metadata(&memory).context("the snapshot keeps the golden's RAM file")?;
    assert_eq!(meta.len(), 512 << 20, "the file is the guest's RAM");
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o600);
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), rustix::process::geteuid().as_raw());
    let state_len = std::fs::metadata(snap_dir.join("state"))?.len();
    assert!(state_len < 8 << 20, "the migration stream holds no RAM: {state_len} bytes");
    let mtime = meta.modified()?;

    let mut clones = Vec::new();
    for n in 0..2 {
        let clone = driver.restore(&snap, &VmId::generate("clone")).await.context("restore")?;
        assert_eq!(clone.spec.ram, vmm::Ram::Private);
        driver.wait_agent(&clone, Duration::from_secs(60)).await.context("clone agent")?;
        assert_jailed(&clone)?;
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", clone.pid))?;
        assert!(maps.contains("/memfd:chrysalis-golden-ram"), "clone {n} maps the sealed copy");
        assert!(!maps.contains(&memory.display().to_string()), "clone {n} never maps the golden's file");
        clones.push(clone);
    }
    let mut a = agent(&driver, &clones[0]).await?;
    let mut b = agent(&driver, &clones[1]).await?;
    assert_eq!(exec_ok(&mut a, &["cat", "/dev/shm/marker"]).await?, "golden\n");
    exec_ok(&mut a, &["sh", "-c", "echo clone-a > /dev/shm/marker"]).await?;
    assert_eq!(exec_ok(&mut b, &["cat", "/dev/shm/marker"]).await?, "golden\n", "a clone's writes are its own");
    drop(b);
    for c in &clones {
        let (rss, pss) = test_infra::rss_pss_kib(c.pid).context("smaps_rollup of a clone")?;
        let shared = golden_ram_shared_kib(c.pid)?;
        eprintln!("clone {}: RSS {rss} KiB, PSS {pss} KiB, golden RAM shared with the other {shared} KiB", c.id);
        assert!(shared >= 4096, "clone {}: the golden's pages are one copy for both clones ({shared} KiB)", c.id);
        assert!(pss < rss, "clone {}: RSS {rss} KiB, PSS {pss} KiB", c.id);
    }
    assert_eq!(std::fs::metadata(&memory)?.modified()?, mtime, "no clone wrote the golden's file");
    // A paused clone (as a warm VM waits) runs again on resume.
    for _ in 0..3 {
        driver.pause(&clones[1]).await?;
        let t0 = std::time::Instant::now();
        driver.resume(&clones[1]).await?;
        eprintln!("resume of a paused clone: {:?}", t0.elapsed());
    }
    let mut b = agent(&driver, &clones[1]).await?;
    assert_eq!(exec_ok(&mut b, &["cat", "/dev/shm/marker"]).await?, "golden\n");
    drop(b);

    // A full snapshot of a clone (its RAM is private) restores under the same RAM block.
    drop(a);
    let full = driver.snapshot(&clones[0], &state.path().join("clone-a"), AfterSnapshot::Resumed).await?;
    assert!(!full.dir.join("memory").exists());
    let again = driver.restore(&full, &VmId::generate("again")).await.context("restore of a clone's snapshot")?;
    driver.wait_agent(&again, Duration::from_secs(60)).await?;
    let mut c = agent(&driver, &again).await?;
    assert_eq!(exec_ok(&mut c, &["cat", "/dev/shm/marker"]).await?, "clone-a\n");
    drop(c);
    for vm in clones.iter().chain([&again]) {
        driver.kill(vm).await?;
    }
    let left = qemu_processes_under(state.path());
    assert!(left.is_empty(), "QEMU processes left behind: {left:?}");
    Ok(())
}
