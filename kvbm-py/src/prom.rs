//! kvbm's metrics over HTTP for Prometheus to scrape.
//!
//! The tier engine records its metrics through the `metrics` facade;
//! [`start_metrics_server`] installs kvbm-pool's Prometheus recorder for
//! the whole process and serves its exposition text on a TCP port, one
//! short-lived connection per scrape, from a thread of its own.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::error::PyKvbmError;

/// The process's recorder, installed once.
static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
/// The address served, once started.
static SERVING: Mutex<Option<(String, u16)>> = Mutex::new(None);

fn handle() -> Result<&'static PrometheusHandle, PyKvbmError> {
    if let Some(h) = HANDLE.get() {
        return Ok(h);
    }
    let h = kvbm_pool::metrics::install_prometheus().map_err(|e| {
        PyKvbmError::Metrics(format!("cannot install the Prometheus recorder: {e}"))
    })?;
    Ok(HANDLE.get_or_init(|| h))
}

/// Answers one scrape: any request gets the current exposition text.
fn serve(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut request = [0u8; 4096];
    // The request line is all a scrape sends that matters, and every path
    // gets the same page: read what arrived and answer.
    let _ = stream.read(&mut request)?;
    handle.run_upkeep();
    let body = handle.render();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// Installs kvbm's Prometheus recorder in this process and serves the
/// metrics (names `kvbm_*`, see docs/vllm.md) on `host:port` over HTTP;
/// port 0 picks a free one. Returns the port served. A second call gives
/// the port already served (one exporter per process); a port that cannot
/// be bound is an error.
#[pyfunction]
#[pyo3(signature = (port, host = "127.0.0.1"))]
pub fn start_metrics_server(port: u16, host: &str) -> PyResult<u16> {
    let mut serving = SERVING.lock();
    if let Some((_, served)) = serving.as_ref() {
        return Ok(*served);
    }
    let handle = handle()?;
    let listener = TcpListener::bind((host, port))
        .map_err(|e| PyKvbmError::Metrics(format!("cannot serve metrics on {host}:{port}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| PyKvbmError::Metrics(format!("metrics listener: {e}")))?
        .port();
    std::thread::Builder::new()
        .name("kvbm-metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                // A scrape that breaks off is the scraper's problem.
                let _ = serve(stream, handle);
            }
        })
        .map_err(|e| PyKvbmError::Metrics(format!("cannot start the metrics server: {e}")))?;
    *serving = Some((host.to_owned(), bound));
    Ok(bound)
}
