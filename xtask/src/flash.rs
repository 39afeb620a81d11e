//! `cargo xtask flash --image FILE --device DEV [--yes]`: writes a built disk image to a block
//! device. Refuses a non-block target (unless `--allow-file`, for tests) and a device that is
//! mounted (itself or a partition), asks to type the device name unless `--yes`, writes with a
//! progress bar, fsyncs, and verifies by reading the written range back (sha256).

use crate::flags::FlashArgs;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{BufRead, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// I/O chunk size.
const CHUNK: usize = 4 << 20;

pub fn run(args: &FlashArgs) -> Result<()> {
    let stdin = std::io::stdin();
    flash(args, &mut stdin.lock())
}

/// The whole flow, with the confirmation read from `answer`.
pub fn flash(args: &FlashArgs, answer: &mut dyn BufRead) -> Result<()> {
    let image_len = fs::metadata(&args.image).with_context(|| format!("reading {}", args.image.display()))?.len();
    let meta = fs::metadata(&args.device).with_context(|| format!("no device {}", args.device.display()))?;
    let is_block = meta.file_type().is_block_device();
    let acceptable = is_block || (args.allow_file && meta.is_file());
    if !acceptable {
        bail!("{} is not a block device (pass --allow-file to write a regular file)", args.device.display());
    }
    if is_block {
        if let Some(m) = mounted(&args.device)? {
            bail!("{} is in use: {m} is mounted; unmount it first", args.device.display());
        }
        let size = block_size(&args.device)?;
        if size < image_len {
            bail!("{} holds {size} bytes, the image needs {image_len}", args.device.display());
        }
    }
    let name = args.device.display().to_string();
    if !args.yes {
        eprintln!(
            "flash: this ERASES everything on {name} and writes {} ({} MiB).\nType the device name ({name}) to continue:",
            args.image.display(),
            image_len >> 20
        );
        let mut line = String::new();
        answer.read_line(&mut line)?;
        if line.trim() != name {
            bail!("confirmation did not match {name}: nothing written");
        }
    }

    let started = std::time::Instant::now();
    let bar = indicatif::ProgressBar::new(image_len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("flash: {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut src = fs::File::open(&args.image)?;
    let mut dst = fs::OpenOptions::new().write(true).open(&args.device).with_context(|| format!("opening {name}"))?;
    let mut written = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = read_full(&mut src, &mut buf)?;
        if n == 0 {
            break;
        }
        written.update(&buf[..n]);
        dst.write_all(&buf[..n]).with_context(|| format!("writing {name}"))?;
        bar.inc(n as u64);
    }
    dst.sync_all().with_context(|| format!("fsync {name}"))?;
    bar.finish_and_clear();
    let written = hex::encode(written.finalize());
    eprintln!("flash: wrote {} MiB in {:.1}s; verifying", image_len >> 20, started.elapsed().as_secs_f64());
    drop(dst);

    // Read back exactly the image's length (a device is bigger than the image).
    let mut back = fs::File::open(&args.device)?;
    back.seek(SeekFrom::Start(0))?;
    let mut h = Sha256::new();
    let mut left = image_len;
    while left > 0 {
        let want = (left as usize).min(CHUNK);
        let n = read_full(&mut back, &mut buf[..want])?;
        if n == 0 {
            bail!("{name} ended {left} bytes before the image did");
        }
        h.update(&buf[..n]);
        left -= n as u64;
    }
    let read = hex::encode(h.finalize());
    if read != written {
        bail!("verification FAILED: wrote sha256 {written}, read back {read}");
    }
    eprintln!("flash: verified sha256 {written}");
    Ok(())
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let r = f.read(&mut buf[n..])?;
        if r == 0 {
            break;
        }
        n += r;
    }
    Ok(n)
}

/// The first mount (`/proc/self/mountinfo`) of the device or one of its partitions.
fn mounted(device: &Path) -> Result<Option<String>> {
    let dev = fs::canonicalize(device)?;
    let base = dev.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // The device's own dev_t and its partitions' (sysfs lists them as subdirectories).
    let mut devs = Vec::new();
    let sys = Path::new("/sys/class/block").join(&base);
    if let Ok(d) = fs::read_to_string(sys.join("dev")) {
        devs.push(d.trim().to_string());
    }
    if let Ok(entries) = fs::read_dir(&sys) {
        for e in entries.flatten() {
            if let Ok(d) = fs::read_to_string(e.path().join("dev")) {
                devs.push(d.trim().to_string());
            }
        }
    }
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let swaps = fs::read_to_string("/proc/swaps").unwrap_or_default();
    Ok(in_use(&devs, &dev.display().to_string(), &info, &swaps))
}

/// Where one of `devs` (`major:minor`) is mounted according to `mountinfo`, or where
/// `dev_path` (or one of its partitions) is swap according to `swaps` (swap is not in
/// mountinfo).
fn in_use(devs: &[String], dev_path: &str, mountinfo: &str, swaps: &str) -> Option<String> {
    for line in mountinfo.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() > 4 && devs.iter().any(|d| d == f[2]) {
            return Some(format!("{} (dev {})", f[4], f[2]));
        }
    }
    swaps
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .find(|path| path.starts_with(dev_path))
        .map(|path| format!("swap {path}"))
}

/// A block device's size in bytes (seek to its end).
fn block_size(device: &Path) -> Result<u64> {
    let mut f = fs::File::open(device)?;
    Ok(f.seek(SeekFrom::End(0))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn args(image: PathBuf, device: PathBuf, yes: bool, allow_file: bool) -> FlashArgs {
        FlashArgs { image, device, yes, allow_file }
    }

    fn image(dir: &Path) -> PathBuf {
        let p = dir.join("disk.raw");
        let data: Vec<u8> = (0..(CHUNK + 12345)).map(|i| (i % 251) as u8).collect();
        fs::write(&p, data).expect("image");
        p
    }

    #[test]
    fn writes_and_verifies_a_file_target() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = image(dir.path());
        let target = dir.path().join("target");
        fs::write(&target, vec![0xffu8; CHUNK * 2]).expect("target");
        let name = target.display().to_string();
        flash(&args(img.clone(), target.clone(), false, true), &mut format!("{name}\n").as_bytes()).expect("flash");
        let want = fs::read(&img).expect("img");
        let got = fs::read(&target).expect("target");
        assert_eq!(&got[..want.len()], &want[..]);
        assert!(got[want.len()..].iter().all(|&b| b == 0xff), "bytes past the image are untouched");
    }

    #[test]
    fn refuses_files_without_allow_file_and_a_wrong_confirmation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = image(dir.path());
        let target = dir.path().join("target");
        fs::write(&target, b"keep").expect("target");
        let err =
            flash(&args(img.clone(), target.clone(), true, false), &mut &b""[..]).expect_err("not a block device");
        assert!(err.to_string().contains("not a block device"), "{err}");
        let err = flash(&args(img, target.clone(), false, true), &mut &b"/dev/sda\n"[..]).expect_err("wrong name");
        assert!(err.to_string().contains("did not match"), "{err}");
        assert_eq!(fs::read(&target).expect("target"), b"keep");
    }

    #[test]
    fn a_mounted_device_or_swap_is_detected() {
        let mountinfo = "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n\
                         23 22 0:5 / /dev rw - devtmpfs udev rw\n";
        let swaps = "Filename Type Size Used Priority\n/dev/sdb2 partition 1024 0 -2\n";
        // sda's partition 1 holds /.
        let sda = ["8:0".to_string(), "8:1".to_string()];
        assert_eq!(in_use(&sda, "/dev/sda", mountinfo, swaps).as_deref(), Some("/ (dev 8:1)"));
        // sdb is not mounted, but its partition 2 is swap.
        let sdb = ["8:16".to_string(), "8:18".to_string()];
        assert_eq!(in_use(&sdb, "/dev/sdb", mountinfo, swaps).as_deref(), Some("swap /dev/sdb2"));
        // sdc is free.
        assert_eq!(in_use(&["8:32".to_string()], "/dev/sdc", mountinfo, swaps), None);
    }
}
