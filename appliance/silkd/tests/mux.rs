//! silkd behind the agent mux: a host `agent_mux::host::Session` over a socket pair talks to
//! the guest end serving silkd's handler, exactly as the QEMU driver will.

use serde_json::Value;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[tokio::test]
async fn silkd_serves_its_port_over_the_mux_and_refuses_others() {
    let (host_io, guest_io) = tokio::net::UnixStream::pair().expect("pair");
    let agent = silkd::Agent::new();
    tokio::spawn(agent_mux::guest::serve(guest_io, silkd::mux::handler(agent, 2048)));
    let session = agent_mux::host::Session::over(host_io, Duration::from_secs(10)).await.expect("mux session");
    assert!(session.open(2049).await.is_err(), "nothing listens on 2049");
    let stream = session.open(2048).await.expect("open 2048");
    let (rd, mut wr) = tokio::io::split(stream);
    let mut rd = BufReader::new(rd);
    wr.write_all(b"{\"v\":1,\"op\":\"info\"}\n{\"v\":1,\"op\":\"exec\",\"argv\":[\"echo\",\"mux\"]}\n{\"v\":1,\"op\":\"stdin_close\"}\n")
        .await
        .expect("write");
    let mut types = Vec::new();
    let mut out = String::new();
    loop {
        let mut line = String::new();
        let n = tokio::time::timeout(Duration::from_secs(20), rd.read_line(&mut line))
            .await
            .expect("timely")
            .expect("read");
        assert!(n > 0, "stream closed");
        let f: Value = serde_json::from_str(&line).expect("json");
        let ty = f["type"].as_str().unwrap_or("").to_string();
        if ty == "stdout" {
            use base64::Engine as _;
            let data = base64::engine::general_purpose::STANDARD.decode(f["data"].as_str().unwrap_or("")).expect("b64");
            out.push_str(&String::from_utf8_lossy(&data));
        }
        types.push(ty.clone());
        if ty == "exit" {
            assert_eq!(f["code"], 0);
            break;
        }
    }
    assert_eq!(types.first().map(String::as_str), Some("info"));
    assert_eq!(types.get(1).map(String::as_str), Some("started"));
    assert_eq!(out, "mux\n");
}

/// The control port is served over the mux too. Only an unknown command is sent: `POWEROFF`
/// would signal the real PID 1 (its flow is unit-tested in `silkd::control` with a fake).
#[tokio::test]
async fn silkd_serves_the_control_port_over_the_mux() {
    use tokio::io::AsyncReadExt;
    let (host_io, guest_io) = tokio::net::UnixStream::pair().expect("pair");
    let agent = silkd::Agent::new();
    tokio::spawn(agent_mux::guest::serve(guest_io, silkd::mux::handler(agent, 2048)));
    let session = agent_mux::host::Session::over(host_io, Duration::from_secs(10)).await.expect("mux session");
    let mut stream = session.open(wire::CONTROL_PORT).await.expect("open the control port");
    stream.write_all(b"STATUS\n").await.expect("write");
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut reply)).await.expect("timely").expect("read");
    assert_eq!(String::from_utf8_lossy(&reply), "ERR unknown command\n");
}
