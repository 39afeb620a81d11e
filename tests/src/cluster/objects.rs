//! Reading and writing objects with the pinned kubectl as admin: what the end-to-end suites
//! and benchmarks of both virtual nodes share. Errors are strings: these feed test reports.

use std::io::Write as _;
use std::process::Stdio;

use serde_json::Value;

use super::Cluster;

impl Cluster {
    /// `kubectl <args>`; the stdout, or an error carrying the command and its stderr.
    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String, String> {
        let out = self.kubectl().args(args).output().map_err(|e| format!("kubectl: {e}"))?;
        if !out.status.success() {
            return Err(format!("kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl get … -o json`, `None` when it does not exist.
    pub fn get_json(&self, args: &[&str]) -> Result<Option<Value>, String> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        let out = self.kubectl().args(&a).output().map_err(|e| format!("kubectl: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("NotFound") || err.contains("not found") {
                return Ok(None);
            }
            return Err(format!("kubectl {}: {err}", a.join(" ")));
        }
        serde_json::from_slice(&out.stdout).map(Some).map_err(|e| format!("kubectl json: {e}"))
    }

    /// `kubectl apply` of a JSON object (or List) into `ns`.
    pub fn apply_json(&self, ns: &str, object: &Value) -> Result<(), String> {
        let mut child = self
            .kubectl()
            .args(["apply", "-n", ns, "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("kubectl: {e}"))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(object.to_string().as_bytes()).map_err(|e| e.to_string())?;
        }
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("kubectl apply: {}", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(())
    }

    /// Events about `object` in `ns` as (type, reason, message).
    pub fn events(&self, ns: &str, object: &str) -> Result<Vec<(String, String, String)>, String> {
        let sel = format!("involvedObject.name={object}");
        let list = self.get_json(&["events", "-n", ns, "--field-selector", &sel])?.unwrap_or_default();
        Ok(list["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .map(|e| {
                        let s = |k: &str| e[k].as_str().unwrap_or_default().to_string();
                        (s("type"), s("reason"), s("message"))
                    })
                    .collect()
            })
            .unwrap_or_default())
    }
}
