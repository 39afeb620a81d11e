//! The box's own secrets, made on first boot in the state directory and reused on every later
//! boot: sandboxd's root token and the box's TLS certificate.
//!
//! | what | where | when |
//! |---|---|---|
//! | sandboxd's root token | `sandboxd.api_token_file`, else `<state>/secrets/sandboxd-token` (64 hex = 256 random bits, 0600 in a 0700 directory) | always: the appliance never runs sandboxd without a token |
//! | the box certificate | `supervisor.tls_cert_file`/`tls_key_file`, else `<state>/tls/cert.pem` + `key.pem` (self-signed P-256, key 0600 in a 0700 directory) | when a TCP surface serves TLS |
//!
//! A TCP surface serves TLS when it listens beyond loopback, or when a certificate is configured
//! for it: the remote API and `metrics_listen` use the box certificate; sandboxd uses its own
//! pair (`sandboxd.tls_cert_file`/`tls_key_file`) or the box's. The minted certificate names the
//! hostname, `localhost`, `127.0.0.1`, `::1`, the addresses the surfaces listen on or advertise,
//! and `supervisor.tls_names`; its names are fixed when it is minted (to change them, configure
//! a certificate of your own).
//!
//! Everything is written through [`foundation`]: a file is born with its final mode, so there is
//! no moment at which a secret is readable by anyone but root.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::Settings;
use crate::layout::Layout;

/// `<state>/secrets`: the minted tokens.
pub const SECRETS_DIR: &str = "secrets";
/// The minted sandboxd root token, in [`SECRETS_DIR`].
pub const SANDBOXD_TOKEN: &str = "sandboxd-token";
/// `<state>/tls`: the minted certificate and key.
pub const TLS_DIR: &str = "tls";

/// Why the secrets could not be prepared (the supervisor then starts no service).
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// The token could not be read or written.
    #[error("sandboxd's root token {}", .path.display())]
    Token {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A certificate could not be minted or read.
    #[error("the TLS certificate for {surfaces}")]
    Tls {
        /// Which surfaces needed it.
        surfaces: String,
        /// The cause.
        #[source]
        source: httpd::tls::TlsError,
    },
}

impl SecretsError {
    /// The configuration key an operator looks at, and the fix.
    pub fn key_and_fix(&self) -> (&'static str, &'static str) {
        match self {
            SecretsError::Token { .. } => (
                "sandboxd.api_token_file",
                "make the state partition writable (supervisor.state_dir), or set sandboxd.api_token_file to a readable token file",
            ),
            SecretsError::Tls { .. } => (
                "supervisor.tls_cert_file",
                "make the state partition writable so the box can mint its certificate, or fix supervisor.tls_cert_file/tls_key_file (PEM)",
            ),
        }
    }
}

/// A certificate a TCP surface serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// The chain (PEM, leaf first).
    pub cert: PathBuf,
    /// The key (PEM).
    pub key: PathBuf,
    /// The leaf's SHA-256 fingerprint.
    pub fingerprint: String,
    /// Minted by the box (self-signed), as opposed to configured.
    pub minted: bool,
}

/// One certificate the box serves, in `GET /v1/status` (never the key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsCert {
    /// The leaf's SHA-256 fingerprint (`AB:CD:…`, as `openssl x509 -fingerprint -sha256`).
    pub fingerprint: String,
    /// The certificate file.
    pub certificate: String,
    /// Minted on first boot by the box (self-signed).
    pub minted: bool,
    /// The surfaces serving it: `api`, `metrics`, `sandboxd`.
    pub surfaces: Vec<String>,
}

/// What the services and listeners run with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Secrets {
    /// sandboxd's root token file (configured or minted).
    pub sandboxd_token_file: PathBuf,
    /// The certificate of the remote API and metrics listeners, when they serve TLS.
    pub api_tls: Option<CertFiles>,
    /// sandboxd's certificate, when it serves TLS.
    pub sandboxd_tls: Option<CertFiles>,
}

impl Secrets {
    /// Plain HTTP everywhere, with this token file (tests, and hosts with nothing to mint).
    pub fn plain(sandboxd_token_file: impl Into<PathBuf>) -> Self {
        Secrets { sandboxd_token_file: sandboxd_token_file.into(), api_tls: None, sandboxd_tls: None }
    }

    /// The certificates served, for the status.
    pub fn served(&self, api_listen: bool, metrics_listen: bool) -> Vec<TlsCert> {
        let mut out: Vec<TlsCert> = Vec::new();
        let mut add = |c: &CertFiles, surface: &str| match out.iter_mut().find(|t| t.fingerprint == c.fingerprint) {
            Some(t) => t.surfaces.push(surface.into()),
            None => out.push(TlsCert {
                fingerprint: c.fingerprint.clone(),
                certificate: c.cert.display().to_string(),
                minted: c.minted,
                surfaces: vec![surface.into()],
            }),
        };
        if let Some(c) = &self.api_tls {
            if api_listen {
                add(c, "api");
            }
            if metrics_listen {
                add(c, "metrics");
            }
        }
        if let Some(c) = &self.sandboxd_tls {
            add(c, "sandboxd");
        }
        out
    }
}

/// `<state>/secrets/sandboxd-token`.
pub fn minted_token_path(layout: &Layout) -> PathBuf {
    layout.state_dir.join(SECRETS_DIR).join(SANDBOXD_TOKEN)
}

/// Reads the token at `path`, or mints one there (256 random bits as 64 hex digits). An
/// existing token is kept, its file and directory tightened to 0600/0700. Returns whether it
/// was minted now.
pub fn ensure_token(path: &Path) -> Result<bool, SecretsError> {
    use std::os::unix::fs::PermissionsExt as _;
    let err = |source| SecretsError::Token { path: path.to_path_buf(), source };
    match std::fs::read_to_string(path) {
        Ok(t) if !t.trim().is_empty() => {
            if let Some(dir) = path.parent() {
                foundation::private_dir(dir).map_err(err)?;
            }
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
            return Ok(false);
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let bytes: [u8; 32] = rand::random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    foundation::write_secret(path, format!("{hex}\n").as_bytes()).map_err(err)?;
    Ok(true)
}

/// Serves TLS: beyond loopback, or because a certificate is configured for it.
fn wants_tls(listen: Option<SocketAddr>, configured: bool) -> bool {
    listen.is_some_and(|a| configured || !a.ip().is_loopback())
}

/// The names the minted certificate carries (see the module doc), deduplicated, hostname first.
pub fn cert_names(settings: &Settings, hostname: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut push = |n: String| {
        if !n.is_empty() && !names.contains(&n) {
            names.push(n);
        }
    };
    push(hostname.trim_end_matches('.').to_ascii_lowercase());
    for n in ["localhost", "127.0.0.1", "::1"] {
        push(n.to_string());
    }
    let specific = |ip: IpAddr| (!ip.is_unspecified()).then(|| ip.to_string());
    for a in [settings.api_listen, settings.metrics_listen, Some(settings.sandboxd_listen)].into_iter().flatten() {
        if let Some(ip) = specific(a.ip()) {
            push(ip);
        }
    }
    if let Some(adv) = &settings.config.sandboxd.advertise_addr {
        let host = match adv.parse::<SocketAddr>() {
            Ok(a) => a.ip().to_string(),
            Err(_) => adv.rsplit_once(':').map(|(h, _)| h).unwrap_or(adv).trim_matches(['[', ']']).to_string(),
        };
        push(host);
    }
    for n in &settings.config.supervisor.tls_names {
        push(n.clone());
    }
    names
}

fn configured(cert: Option<&Path>, key: Option<&Path>, surfaces: &str) -> Result<Option<CertFiles>, SecretsError> {
    let (Some(cert), Some(key)) = (cert, key) else { return Ok(None) };
    let tls = |source| SecretsError::Tls { surfaces: surfaces.to_string(), source };
    // Loadable as a server configuration, or the listeners could not start.
    httpd::tls::server_config_from_files(cert, key, httpd::tls::ALPN_HTTP1).map_err(tls)?;
    let fingerprint = httpd::tls::file_fingerprint(cert).map_err(tls)?;
    Ok(Some(CertFiles { cert: cert.to_path_buf(), key: key.to_path_buf(), fingerprint, minted: false }))
}

/// Makes or finds everything [`Secrets`] names (see the module doc).
pub fn prepare(settings: &Settings, layout: &Layout, hostname: &str) -> Result<Secrets, SecretsError> {
    let sv = &settings.config.supervisor;
    let sb = &settings.config.sandboxd;
    let sandboxd_token_file = match &sb.api_token_file {
        Some(p) => p.clone(),
        None => {
            let p = minted_token_path(layout);
            if ensure_token(&p)? {
                tracing::info!(file = %p.display(), "minted sandboxd's root token");
            }
            p
        }
    };

    let box_configured = sv.tls_cert_file.is_some();
    let sandboxd_own = sb.tls_cert_file.is_some();
    let api_wants =
        wants_tls(settings.api_listen, box_configured) || wants_tls(settings.metrics_listen, box_configured);
    let sandboxd_wants = sb.enabled && (sandboxd_own || wants_tls(Some(settings.sandboxd_listen), box_configured));
    let box_needed = api_wants || (sandboxd_wants && !sandboxd_own);

    let box_cert = if !box_needed {
        None
    } else if let Some(c) = configured(sv.tls_cert_file.as_deref(), sv.tls_key_file.as_deref(), "the box")? {
        Some(c)
    } else {
        let dir = layout.state_dir.join(TLS_DIR);
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        let names = cert_names(settings, hostname);
        let e = httpd::tls::ensure_self_signed(&cert, &key, &names)
            .map_err(|source| SecretsError::Tls { surfaces: "the box".into(), source })?;
        if e.minted {
            tracing::info!(file = %cert.display(), ?names, "minted the box's TLS certificate");
        }
        Some(CertFiles { cert, key, fingerprint: e.fingerprint, minted: true })
    };
    let sandboxd_tls = if !sandboxd_wants {
        None
    } else if sandboxd_own {
        configured(sb.tls_cert_file.as_deref(), sb.tls_key_file.as_deref(), "sandboxd")?
    } else {
        box_cert.clone()
    };
    let api_tls = if api_wants { box_cert } else { None };
    for c in [&api_tls, &sandboxd_tls].into_iter().flatten() {
        // In the message too, so a text console or `journalctl | grep` shows it whole.
        tracing::info!(
            fingerprint = %c.fingerprint,
            certificate = %c.cert.display(),
            minted = c.minted,
            "TLS certificate SHA-256 fingerprint {}",
            c.fingerprint
        );
    }
    Ok(Secrets { sandboxd_token_file, api_tls, sandboxd_tls })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;
    use crate::config::{self, ValidateEnv};
    use std::os::unix::fs::PermissionsExt as _;

    fn settings(text: &str) -> Settings {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        config::load_files(&[p]).unwrap().validate(&ValidateEnv { hostname: "box".into(), check_files: false }).unwrap()
    }

    fn layout(dir: &Path) -> Layout {
        Layout {
            state_dir: dir.join("state"),
            run_dir: dir.join("run"),
            bin_dir: "/bin".into(),
            default_catalog: "/cat.json".into(),
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn the_token_is_minted_once_0600_in_a_0700_dir_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout(dir.path());
        let s = settings("[sandboxd]\nlisten = \"127.0.0.1:7777\"\n");
        let first = prepare(&s, &l, "box").unwrap();
        assert_eq!(first.sandboxd_token_file, l.state_dir.join("secrets/sandboxd-token"));
        let token = std::fs::read_to_string(&first.sandboxd_token_file).unwrap();
        assert_eq!(token.trim().len(), 64, "256 bits as hex");
        assert!(token.trim().bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(mode(&first.sandboxd_token_file), 0o600);
        assert_eq!(mode(&l.state_dir.join("secrets")), 0o700);
        // Loopback only, nothing configured: no certificate at all.
        assert_eq!((first.api_tls.clone(), first.sandboxd_tls.clone()), (None, None));
        assert!(!l.state_dir.join("tls").exists());
        // A second start keeps the token, and tightens modes an operator loosened.
        std::fs::set_permissions(&first.sandboxd_token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(l.state_dir.join("secrets"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let again = prepare(&s, &l, "box").unwrap();
        assert_eq!(std::fs::read_to_string(&again.sandboxd_token_file).unwrap(), token);
        assert_eq!(mode(&again.sandboxd_token_file), 0o600);
        assert_eq!(mode(&l.state_dir.join("secrets")), 0o700);
    }

    #[test]
    fn an_operator_token_file_wins_and_nothing_is_minted() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout(dir.path());
        let s = settings("[sandboxd]\nlisten = \"127.0.0.1:7777\"\napi_token_file = \"/etc/op-token\"\n");
        let sec = prepare(&s, &l, "box").unwrap();
        assert_eq!(sec.sandboxd_token_file, PathBuf::from("/etc/op-token"));
        assert!(!l.state_dir.join("secrets").exists(), "nothing minted when the operator gives a token");
    }

    #[test]
    fn beyond_loopback_a_certificate_is_minted_shared_and_kept_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout(dir.path());
        let s = settings(
            "[supervisor]\napi_listen = \"0.0.0.0:7780\"\napi_token_file = \"/t\"\ntls_names = [\"box1.example.com\"]\n\
             [sandboxd]\nadvertise_addr = \"10.0.0.5:7777\"\n",
        );
        let first = prepare(&s, &l, "Box").unwrap();
        let api = first.api_tls.clone().expect("the API serves TLS beyond loopback");
        assert_eq!(first.sandboxd_tls.as_ref(), Some(&api), "sandboxd shares the box certificate");
        assert!(api.minted);
        assert_eq!(api.cert, l.state_dir.join("tls/cert.pem"));
        assert_eq!(mode(&api.key), 0o600);
        assert_eq!(mode(&l.state_dir.join("tls")), 0o700);
        assert_eq!(httpd::tls::file_fingerprint(&api.cert).unwrap(), api.fingerprint);
        // Restarted: the same certificate (a pinned fingerprint stays valid).
        let again = prepare(&s, &l, "box").unwrap();
        assert_eq!(again.api_tls.unwrap().fingerprint, api.fingerprint);
        let names = cert_names(&s, "Box");
        assert_eq!(names, ["box", "localhost", "127.0.0.1", "::1", "10.0.0.5", "box1.example.com"]);
        let served = first.served(true, false);
        assert_eq!(served.len(), 1);
        assert_eq!(served[0].surfaces, ["api", "sandboxd"]);
    }

    #[test]
    fn configured_certificates_win_and_sandboxd_may_have_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout(dir.path());
        let mk = |name: &str| {
            let (c, k) = (dir.path().join(format!("{name}.crt")), dir.path().join(format!("{name}.key")));
            httpd::tls::ensure_self_signed(&c, &k, &["x".into()]).unwrap();
            (c, k)
        };
        let (bc, bk) = mk("box");
        let (sc, sk) = mk("sbx");
        // A configured box certificate is served even on loopback; sandboxd has its own.
        let s = settings(&format!(
            "[supervisor]\napi_listen = \"127.0.0.1:7780\"\napi_token_file = \"/t\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n\
             [sandboxd]\nlisten = \"127.0.0.1:7777\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
            bc.display(),
            bk.display(),
            sc.display(),
            sk.display()
        ));
        let sec = prepare(&s, &l, "box").unwrap();
        assert_eq!(sec.api_tls.as_ref().unwrap().cert, bc);
        assert!(!sec.api_tls.as_ref().unwrap().minted);
        assert_eq!(sec.sandboxd_tls.as_ref().unwrap().cert, sc);
        assert!(!l.state_dir.join("tls").exists(), "nothing minted");
        assert_eq!(sec.served(true, false).len(), 2);
        // A broken configured pair is an error naming the surface.
        std::fs::write(&bk, "garbage").unwrap();
        let e = prepare(&s, &l, "box").unwrap_err();
        assert!(matches!(e, SecretsError::Tls { .. }), "{e:?}");
        assert_eq!(e.key_and_fix().0, "supervisor.tls_cert_file");
    }

    #[test]
    fn an_unwritable_state_directory_is_an_error_not_an_open_sandboxd() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("state"), b"a file, not a directory").unwrap();
        let l = layout(dir.path());
        let e = prepare(&settings(""), &l, "box").unwrap_err();
        assert!(matches!(e, SecretsError::Token { .. }), "{e:?}");
    }
}
