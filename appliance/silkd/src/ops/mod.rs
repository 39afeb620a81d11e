//! One module per op family. Each op is `async fn(&mut Rpc, …) -> Result<(), OpError>`.

pub mod fs;
