//! Real guests under QEMU from the built catalog: boot `base`, reach silkd through the
//! virtio-serial mux (`CONNECT 2048` → `OK`, then `info`), snapshot, clone, reach the clone.
//! Prints `SKIP: …` and returns when QEMU, the catalog or the kernel is absent.

use std::time::{Duration, Instant};

use vmm::qemu::{QemuConfig, QemuDriver};
use vmm::{AfterSnapshot, BootSpec, Catalog, Driver, SizeClass, Vm, VmId, AGENT_PORT};

fn console(vm: &Vm) -> String {
    std::fs::read_to_string(&vm.console_log).unwrap_or_default()
}

/// Dials port 2048 until the guest answers `OK`, then asks silkd `info`.
async fn reach_agent(d: &QemuDriver, vm: &Vm, budget: Duration) -> Result<vmm::AgentInfo, String> {
    let t0 = Instant::now();
    let info = d.wait_agent(vm, budget).await.map_err(|e| vmm::error_chain(&e))?;
    println!("vm {}: agent answered after {:?}: {info:?}", vm.id, t0.elapsed());
    Ok(info)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_base_reach_agent_snapshot_and_clone() {
    let catalog = match Catalog::load_default() {
        Ok(c) => c,
        Err(e) => {
            println!("SKIP: no image catalog ({})", vmm::error_chain(&e));
            return;
        }
    };
    let spec = match BootSpec::from_template(&catalog, "base", SizeClass::Small) {
        Ok(s) if s.kernel.is_file() && s.initrd.is_file() => s,
        Ok(s) => {
            println!("SKIP: base template files missing ({} / {})", s.kernel.display(), s.initrd.display());
            return;
        }
        Err(e) => {
            println!("SKIP: no base template ({})", vmm::error_chain(&e));
            return;
        }
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = QemuDriver::new(QemuConfig { state_dir: tmp.path().join("state"), ..QemuConfig::from_env() });
    let t0 = Instant::now();
    let vm = d.boot(&spec).await.expect("boot base");
    println!("vm {}: qemu up after {:?} ({})", vm.id, t0.elapsed(), vm.accel);

    let r = reach_agent(&d, &vm, Duration::from_secs(180)).await;
    if let Err(e) = &r {
        let c = console(&vm);
        let _ = d.kill(&vm).await;
        panic!("agent unreachable: {e}\n--- console ---\n{c}");
    }
    let info = r.expect("checked above");
    assert_eq!(info.proto, 2);

    // The mux carries independent streams: a second one while the first is open.
    let s1 = d.connect(&vm, AGENT_PORT).await.expect("stream 1");
    let mut s2 = d.connect(&vm, AGENT_PORT).await.expect("stream 2");
    assert!(vmm::agent::info(&mut s2).await.is_ok());
    drop(s1);

    let snapdir = tmp.path().join("snap");
    let t1 = Instant::now();
    let snap = d.snapshot(&vm, &snapdir, AfterSnapshot::Resumed).await.expect("snapshot");
    println!("snapshot in {:?}", t1.elapsed());
    let t2 = Instant::now();
    let clone = d.restore(&snap, &VmId::new("base-clone").expect("id")).await.expect("restore");
    println!("restore in {:?}", t2.elapsed());
    let r = reach_agent(&d, &clone, Duration::from_secs(60)).await;
    let parent_again = reach_agent(&d, &vm, Duration::from_secs(30)).await;
    let clone_console = console(&clone);
    d.kill(&clone).await.expect("kill clone");
    d.shutdown(&vm, Duration::from_secs(2)).await.expect("shutdown parent");
    r.unwrap_or_else(|e| panic!("clone agent unreachable: {e}\n--- clone console ---\n{clone_console}"));
    parent_again.expect("parent still answers after the snapshot");
    assert!(d.list().await.expect("list").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_rt_with_rootfs_and_overlay() {
    let catalog = match Catalog::load_default() {
        Ok(c) => c,
        Err(e) => {
            println!("SKIP: no image catalog ({})", vmm::error_chain(&e));
            return;
        }
    };
    let spec = match BootSpec::from_template(&catalog, "ubuntu-dev-base", SizeClass::Small) {
        Ok(s)
            if [Some(&s.kernel), Some(&s.initrd), s.rootfs.as_ref(), s.overlay_base.as_ref()]
                .iter()
                .all(|p| p.is_some_and(|p| p.is_file())) =>
        {
            s
        }
        Ok(_) => {
            println!("SKIP: rt template files missing");
            return;
        }
        Err(e) => {
            println!("SKIP: no rt template ({})", vmm::error_chain(&e));
            return;
        }
    };
    assert_eq!(spec.name, "rt", "alias resolves to rt");
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = QemuDriver::new(QemuConfig { state_dir: tmp.path().join("state"), ..QemuConfig::from_env() });
    let vm = d.boot(&spec).await.expect("boot rt");
    assert!(vm.dir.join("overlay.qcow2").is_file(), "per-VM overlay created");
    let r = reach_agent(&d, &vm, Duration::from_secs(180)).await;
    let c = console(&vm);
    d.kill(&vm).await.expect("kill");
    r.unwrap_or_else(|e| panic!("rt agent unreachable: {e}\n--- console ---\n{c}"));
}
