//! Runs the haptic-testkit API server until Ctrl-C and prints the kubeconfig path, so kubectl,
//! the examples and the daemon can be pointed at it with no cluster.

use std::path::PathBuf;

use haptic_testkit::ApiServer;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut kubeconfig: Option<PathBuf> = None;
    let mut user = "admin".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--kubeconfig" => kubeconfig = args.next().map(PathBuf::from),
            "--user" => user = args.next().unwrap_or(user),
            "-h" | "--help" => {
                println!(
                    "haptic-apiserver [--kubeconfig PATH] [--user NAME]\n  serves the Kubernetes API stand-in on 127.0.0.1 until Ctrl-C"
                );
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?} (try --help)").into()),
        }
    }
    let server = ApiServer::start().await?;
    let path = match kubeconfig {
        Some(path) => {
            server.write_kubeconfig(&user, &path)?;
            path
        }
        None => server.kubeconfig_for(&user)?,
    };
    println!("haptic-testkit API server listening on {}", server.url());
    println!("kubeconfig: {}", path.display());
    println!("try: kubectl --kubeconfig {} get leases -A", path.display());
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
