//! Small adapters between kvbm's memory descriptions and nixl-sys: a raw
//! registration descriptor, agent and backend creation, and the in-flight
//! request the poller watches.

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, NixlDescriptor, Params, ThreadSync, XferRequest,
};

use super::error::NixlUnavailable;
use super::poller::InFlight;
use crate::completion::Completer;
use crate::error::{Result, TransferError};

/// One contiguous range to register with NIXL: memory by address
/// (`dev_id` 0 for host memory) or a whole file (`addr` 0, `dev_id` the
/// file descriptor).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawDesc {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) dev_id: u64,
    pub(crate) mem_type: MemType,
}

impl nixl_sys::MemoryRegion for RawDesc {
    unsafe fn as_ptr(&self) -> *const u8 {
        // NIXL only reads the value (an address, or 0 for files).
        self.addr as usize as *const u8
    }

    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for RawDesc {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.dev_id
    }
}

/// Creates an agent named `name` without NIXL's own progress thread
/// unless `progress_thread` (a UCX target must progress to serve reads
/// over TCP), and a backend of `plugin` with `params`.
pub(crate) fn agent_with_backend(
    name: &str,
    plugin: &'static str,
    params: &[(&str, &str)],
    progress_thread: bool,
) -> std::result::Result<(Agent, Backend), NixlUnavailable> {
    super::runtime()?;
    let setup = |what: &'static str| {
        move |e: nixl_sys::NixlError| NixlUnavailable::Setup {
            what,
            detail: e.to_string(),
        }
    };
    let config = AgentConfig {
        enable_prog_thread: progress_thread,
        enable_listen_thread: false,
        pthr_delay_us: 100,
        // Requests are created on callers' threads and polled on the
        // poller's: NIXL must serialise its own state.
        thread_sync: ThreadSync::Strict,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &config).map_err(setup("agent"))?;
    let plugins = agent
        .get_available_plugins()
        .map_err(setup("plugin list"))?;
    let names: Vec<String> = plugins
        .iter()
        .filter_map(|p| p.ok().map(str::to_owned))
        .collect();
    if !names.iter().any(|p| p == plugin) {
        return Err(NixlUnavailable::PluginMissing(plugin, names.join(", ")));
    }
    let params = Params::from(params.iter().copied()).map_err(setup("backend parameters"))?;
    let backend = agent
        .create_backend(plugin, &params)
        .map_err(setup("backend"))?;
    Ok((agent, backend))
}

/// A posted NIXL request and the completer of the job it carries. The
/// request is released only after NIXL reported it finished, so NIXL never
/// touches memory the job no longer keeps alive (`_keep` holds it).
pub(crate) struct Posted<K: Send> {
    pub(crate) agent: Agent,
    pub(crate) request: Option<XferRequest>,
    pub(crate) done: Option<Completer>,
    pub(crate) _keep: K,
    pub(crate) what: &'static str,
}

impl<K: Send> InFlight for Posted<K> {
    fn check(&mut self) -> Option<Result<()>> {
        let Some(req) = self.request.as_ref() else {
            return Some(Err(TransferError::Abandoned(
                "NIXL request already released",
            )));
        };
        match self.agent.get_xfer_status(req) {
            Ok(s) if s.is_success() => Some(Ok(())),
            Ok(_) => None,
            Err(e) => Some(Err(TransferError::Backend {
                backend: "nixl",
                message: format!("{} failed: {e}", self.what),
            })),
        }
    }

    fn finish(mut self: Box<Self>, result: Result<()>) {
        // Release the request before the completion runs callbacks that
        // may free the memory it described.
        drop(self.request.take());
        if let Some(c) = self.done.take() {
            c.complete(result);
        }
    }
}
