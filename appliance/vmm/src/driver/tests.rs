//! Unit tests of the driver types.

use super::*;

#[test]
fn vm_id_validation() {
    assert!(VmId::new("base-0a1b2c3d").is_ok());
    assert_eq!(VmId::new(""), Err(VmIdError::Length(0)));
    assert!(matches!(VmId::new("-x"), Err(VmIdError::Charset(_))));
    assert!(matches!(VmId::new("a/b"), Err(VmIdError::Charset(_))));
    assert!(matches!(VmId::new("A"), Err(VmIdError::Charset(_))));
    assert!(matches!(VmId::new("a".repeat(64)), Err(VmIdError::Length(64))));
    let g = VmId::generate("ghcr.io/Rt:24.04");
    assert!(VmId::new(g.as_str()).is_ok(), "{g}");
    assert!(g.as_str().starts_with("ghcr-io-rt-24-04-"), "{g}");
    assert!(VmId::generate("").as_str().starts_with("vm-"));
}

#[test]
fn vm_id_serde_validates() {
    let id: VmId = serde_json::from_str("\"abc\"").expect("valid id");
    assert_eq!(id.as_str(), "abc");
    assert!(serde_json::from_str::<VmId>("\"../x\"").is_err());
}

fn nic() -> NicSpec {
    NicSpec {
        tap: "ct-0123456789ab".into(),
        mac: "02:aa:bb:cc:dd:ee".into(),
        netns: Some("vmnet-t".into()),
        ip_cidr: "10.88.0.5/24".into(),
        gateway: "10.88.0.1".into(),
    }
}

#[test]
fn nic_spec_validation() {
    nic().validate().expect("valid");
    assert_eq!(nic().kernel_args(), "chrysalis.ip=10.88.0.5/24 chrysalis.gw=10.88.0.1 chrysalis.mac=02:aa:bb:cc:dd:ee");
    assert_eq!(nic().netns_path(), Some(PathBuf::from("/run/netns/vmnet-t")));
    type Breaker = Box<dyn Fn(&mut NicSpec)>;
    let bad: Vec<Breaker> = vec![
        Box::new(|n| n.tap = "ct-x,script=/bin/evil".into()),
        Box::new(|n| n.tap = "a-tap-name-too-long".into()),
        Box::new(|n| n.tap = String::new()),
        Box::new(|n| n.mac = "02:aa:bb:cc:dd".into()),
        Box::new(|n| n.mac = "02:aa:bb:cc:dd:zz".into()),
        Box::new(|n| n.mac = "03:aa:bb:cc:dd:ee".into()),
        Box::new(|n| n.netns = Some("../x".into())),
        Box::new(|n| n.ip_cidr = "10.88.0.5".into()),
        Box::new(|n| n.ip_cidr = "10.88.0.5/33".into()),
        Box::new(|n| n.ip_cidr = "10.88.0.5/24 chrysalis.rootfs=/dev/x".into()),
        Box::new(|n| n.gateway = "gw".into()),
    ];
    for (i, f) in bad.iter().enumerate() {
        let mut n = nic();
        f(&mut n);
        assert!(matches!(n.validate(), Err(DriverError::Invalid(_))), "case {i}: {n:?}");
    }
}

#[test]
fn boot_spec_nic_is_optional_in_json() {
    let old =
        r#"{"name":"base","kernel":"/k","initrd":"/i","rootfs":null,"overlay_base":null,"cmdline":"","size":"small"}"#;
    let spec: BootSpec = serde_json::from_str(old).expect("old spec parses");
    assert_eq!(spec.nic, None);
    assert!(!spec.rng, "a spec recorded before virtio-rng existed has none");
    assert!(!spec.volumes, "nor a volume controller");
    let json = serde_json::to_value(&spec).expect("ser");
    assert!(json.get("nic").is_none(), "no nic key without a NIC: {json}");
    let with = BootSpec { nic: Some(nic()), ..spec };
    let back: BootSpec = serde_json::from_value(serde_json::to_value(&with).expect("ser")).expect("de");
    assert_eq!(back, with);
}

#[test]
fn driver_is_object_safe() {
    fn takes(_: Option<std::sync::Arc<dyn Driver>>) {}
    takes(None);
}
