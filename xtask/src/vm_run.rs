//! `cargo xtask vm run [template] [-- cmd…]`: boot one VM, run a command through silkd (or
//! open an interactive shell over `pty_open`), shut the VM down.

use crate::flags::{VmImageArgs, VmRunArgs};
use anyhow::{bail, Context, Result};
use silkd_client::{AgentConn, ExecOptions};
use std::io::{IsTerminal, Read, Write};
use std::time::Duration;
use vmm::{Driver, SizeClass};
use wire::{Bytes64, Request, Response};

pub fn run(args: &VmRunArgs) -> Result<()> {
    crate::prereqs::ensure_all()?;
    crate::vm_image::run(&VmImageArgs { template: Some(args.template.clone()), all: false, force: false })?;
    let size: SizeClass = args.size.parse().map_err(|e| anyhow::anyhow!("--size: {e}"))?;
    let rt = tokio::runtime::Runtime::new()?;
    let code = rt.block_on(run_async(args, size))?;
    std::process::exit(code);
}

async fn run_async(args: &VmRunArgs, size: SizeClass) -> Result<i32> {
    test_infra::init_tracing();
    let state = tempfile_state()?;
    let driver = test_infra::qemu(&state)?;
    let catalog = test_infra::catalog()?;
    let booted = test_infra::boot(&driver, &catalog, &args.template, size).await?;
    eprintln!(
        "vm run: {} booted on QEMU with {} ({} vCPU, {} MiB); agent ready after {:.2} s",
        args.template,
        booted.vm.accel,
        size.vcpus(),
        size.memory_mib(),
        booted.ready_after.as_secs_f64()
    );
    let result = drive(&driver, &booted.vm, args).await;
    if let Err(e) = driver.shutdown(&booted.vm, Duration::from_secs(10)).await {
        eprintln!("vm run: shutdown: {e}");
    }
    let _ = std::fs::remove_dir_all(&state);
    result
}

fn tempfile_state() -> Result<std::path::PathBuf> {
    let dir = crate::paths::cache_dir().join("vm-run").join(format!("{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

async fn drive(driver: &std::sync::Arc<dyn Driver>, vm: &vmm::Vm, args: &VmRunArgs) -> Result<i32> {
    let mut conn = test_infra::agent(driver, vm).await?;
    if !args.cmd.is_empty() {
        let argv: Vec<&str> = args.cmd.iter().map(String::as_str).collect();
        let mut stdin = Vec::new();
        if args.stdin {
            std::io::stdin().read_to_end(&mut stdin)?;
        }
        let out = conn.exec(&argv, ExecOptions::default(), &stdin).await?;
        std::io::stdout().write_all(&out.stdout)?;
        std::io::stderr().write_all(&out.stderr)?;
        return Ok(out.code);
    }
    if !std::io::stdin().is_terminal() {
        bail!("no command given and stdin is not a terminal: pass `-- cmd…` or run from a terminal");
    }
    interactive(conn).await
}

/// An interactive shell under a guest pty, with the local terminal in raw mode.
async fn interactive(mut conn: AgentConn<vmm::AgentStream>) -> Result<i32> {
    use nix::sys::termios;
    let (cols, rows) = terminal_size();
    conn.send(&Request::PtyOpen { argv: None, cols, rows, cwd: None, env: None, user: None }).await?;
    match conn.recv().await? {
        Response::Started { .. } => {}
        other => bail!("pty_open answered {}", other.type_name()),
    }
    let stdin = std::io::stdin();
    let saved = termios::tcgetattr(&stdin)?;
    let mut raw = saved.clone();
    termios::cfmakeraw(&mut raw);
    termios::tcsetattr(&stdin, termios::SetArg::TCSANOW, &raw)?;
    let result = pump(conn).await;
    termios::tcsetattr(&stdin, termios::SetArg::TCSANOW, &saved)?;
    result
}

async fn pump(conn: AgentConn<vmm::AgentStream>) -> Result<i32> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin();
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || tx.blocking_send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut conn = conn;
    loop {
        tokio::select! {
            input = rx.recv() => match input {
                Some(bytes) => conn.send(&Request::Stdin { data: Bytes64(bytes) }).await?,
                None => conn.send(&Request::StdinClose).await?,
            },
            frame = conn.recv() => match frame? {
                Response::Stdout { data } | Response::Stderr { data } => {
                    let mut out = std::io::stdout();
                    out.write_all(&data.0)?;
                    out.flush()?;
                }
                Response::Exit { code } => return Ok(code),
                _ => {}
            },
        }
    }
}

fn terminal_size() -> (u16, u16) {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes a winsize into the pointer we pass; fd 1 may not be a tty,
    // in which case the call fails and we keep the defaults.
    let ok = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col > 0 && ws.ws_row > 0 {
        (ws.ws_col, ws.ws_row)
    } else {
        (80, 24)
    }
}
