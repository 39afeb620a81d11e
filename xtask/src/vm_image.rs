pub fn run(_a: &crate::flags::VmImageArgs) -> anyhow::Result<()> { anyhow::bail!("not built yet") }
