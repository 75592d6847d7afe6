//! The accept loop, with what `axum::serve` leaves out on an open port: a bound on open
//! connections (past it, new ones wait in the kernel's backlog), and a deadline for a request's
//! headers (hyper's, which needs a timer that `axum::serve` does not set), so a client that
//! sends a byte a second, or connects and sends nothing, cannot hold a connection for good.
//! Bodies have their own deadline where handlers read them (`read_body`).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Limits of the accept loop.
pub struct ConnLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// From a connection's first byte (or its previous response) to a request's last header.
    pub header_timeout: Duration,
}

/// Serve `router` on `listener` until ctrl-c.
pub async fn serve(listener: TcpListener, router: Router, limits: ConnLimits) -> std::io::Result<()> {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let builder = Arc::new(builder);
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            p = open.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = &mut stop => return Ok(()),
        };
        let (stream, _) = tokio::select! {
            s = listener.accept() => match s {
                Ok(s) => s,
                // a failed accept (out of file descriptors, a reset) ends no other connection
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = &mut stop => return Ok(()),
        };
        let service = TowerToHyperService::new(router.clone());
        let builder = builder.clone();
        tokio::spawn(async move {
            let _ = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).await;
            drop(permit);
        });
    }
}
