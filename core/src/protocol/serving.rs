//! Serving the requests of one tarpc connection: quick requests inline, the others in
//! their own tasks.
//!
//! A request answered from memory in a few microseconds (a lookup, a metadata write)
//! costs more to hand to another task than to run: it runs in the connection's own task,
//! and its answer leaves with the next poll of the channel. Requests that may take long
//! (copies of payload, scans of the whole index) get a task each, so that one of them
//! never holds up the quick ones behind it.

use futures::StreamExt;
use tarpc::RequestName;
use tarpc::server::{Channel, InFlightRequest, Serve};

/// Requests one connection may have in flight at once (the tarpc client's own default
/// cap is 1000); a request beyond it is answered at once with a server error (the
/// caller sees `RPC_FAIL`), so a peer cannot make us hold an unbounded number of tasks.
pub const MAX_IN_FLIGHT_PER_CONNECTION: usize = 1024;

/// Serves every request of `channel` with `serve` until the connection closes. Those
/// for which `inline` is true run in this task; the others go to `spawn` (which starts
/// `request.execute(serve)` in a task of its own). At most
/// [`MAX_IN_FLIGHT_PER_CONNECTION`] requests are in flight.
pub async fn serve_connection<C, S>(
    channel: C,
    serve: S,
    inline: fn(&C::Req) -> bool,
    spawn: impl Fn(InFlightRequest<C::Req, C::Resp>, Counted<S>),
) where
    C: Channel,
    C::Req: RequestName,
    S: Serve<Req = C::Req, Resp = C::Resp> + Clone,
{
    let never = futures::future::pending::<()>();
    serve_until_drained(channel, serve, inline, spawn, never).await;
}

/// A server for one request served in a task of its own: while it lives, the request
/// counts as in flight for [`serve_until_drained`].
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    _in_flight: InFlight,
}

/// One request in flight; counted down when dropped (served, or abandoned).
#[derive(Debug)]
struct InFlight(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl<S: Serve> Serve for Counted<S> {
    type Req = S::Req;
    type Resp = S::Resp;

    async fn serve(
        self,
        ctx: tarpc::context::Context,
        req: Self::Req,
    ) -> Result<Self::Resp, tarpc::ServerError> {
        let Counted { inner, _in_flight } = self;
        let answer = inner.serve(ctx, req).await;
        drop(_in_flight);
        answer
    }
}

/// How long a drained connection keeps being polled after its last request finished,
/// so that the answers still queued leave.
const DRAIN_FLUSH: std::time::Duration = std::time::Duration::from_millis(20);

/// [`serve_connection`], until `drain` completes: from then on requests that arrive
/// are not served (dropped unanswered), those already being served finish and their
/// answers are sent, and the connection closes. A peer can therefore tell that a
/// request left unanswered by a drained connection was never served.
pub async fn serve_until_drained<C, S>(
    channel: C,
    serve: S,
    inline: fn(&C::Req) -> bool,
    spawn: impl Fn(InFlightRequest<C::Req, C::Resp>, Counted<S>),
    drain: impl std::future::Future<Output = ()>,
) where
    C: Channel,
    C::Req: RequestName,
    S: Serve<Req = C::Req, Resp = C::Resp> + Clone,
{
    let mut requests = std::pin::pin!(
        channel
            .max_concurrent_requests(MAX_IN_FLIGHT_PER_CONNECTION)
            .requests()
    );
    let mut drain = std::pin::pin!(drain);
    let in_flight = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut draining = false;
    loop {
        let next = if draining {
            if in_flight.load(std::sync::atomic::Ordering::Acquire) == 0 {
                // Everything served is answered once the channel is polled a last time.
                let _ = tokio::time::timeout(DRAIN_FLUSH, requests.next()).await;
                break;
            }
            match tokio::time::timeout(DRAIN_FLUSH, requests.next()).await {
                Ok(next) => next,
                Err(_) => continue,
            }
        } else {
            tokio::select! {
                next = requests.next() => next,
                () = &mut drain => {
                    draining = true;
                    continue;
                }
            }
        };
        let Some(next) = next else { break };
        let request = match next {
            Ok(request) => request,
            Err(error) => {
                // Decoding errors (a frame over 64 MiB, a request over the element
                // budget, bytes that are no request) are the peer's fault: said loudly.
                let detail = format!("{error:?}");
                if detail.contains("InvalidData") {
                    tracing::warn!(%detail, "closed a connection that sent a frame it may not send (over a limit, or not a request)");
                } else {
                    tracing::debug!(%error, "connection closed on a channel error");
                }
                break;
            }
        };
        if draining {
            // Never served: the peer sends it again where it is served now.
            drop(request);
            continue;
        }
        crate::keep_awake::touch();
        if inline(&request.get().message) {
            request.execute(serve.clone()).await;
        } else {
            in_flight.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let counted = Counted {
                inner: serve.clone(),
                _in_flight: InFlight(std::sync::Arc::clone(&in_flight)),
            };
            spawn(request, counted);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tarpc::context;
    use tarpc::server::BaseChannel;

    use super::*;
    use crate::protocol::codec;

    #[tarpc::service]
    trait Slow {
        async fn wait(millis: u64) -> u64;
    }

    #[derive(Clone)]
    struct SlowServer;

    impl Slow for SlowServer {
        async fn wait(self, _: context::Context, millis: u64) -> u64 {
            tokio::time::sleep(Duration::from_millis(millis)).await;
            millis
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_beyond_the_in_flight_cap_are_refused_and_the_rest_served() {
        let (near, far) = tokio::io::duplex(1 << 20);
        tokio::spawn(serve_connection(
            BaseChannel::with_defaults(codec::serving_transport(far)),
            SlowServer.serve(),
            |_| false,
            |request, serve| {
                tokio::spawn(request.execute(serve));
            },
        ));
        let mut config = tarpc::client::Config::default();
        config.max_in_flight_requests = 4 * MAX_IN_FLIGHT_PER_CONNECTION;
        let client = SlowClient::new(config, codec::transport(near)).spawn();
        let calls = (0..MAX_IN_FLIGHT_PER_CONNECTION + 200).map(|_| {
            let client = client.clone();
            async move { client.wait(context::current(), 500).await }
        });
        let results = futures::future::join_all(calls).await;
        let served = results.iter().filter(|r| r.is_ok()).count();
        assert!(served <= MAX_IN_FLIGHT_PER_CONNECTION, "{served} served");
        assert!(
            served >= MAX_IN_FLIGHT_PER_CONNECTION / 2,
            "{served} served"
        );
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(tarpc::client::RpcError::Server(_)))),
            "requests beyond the cap get a server error"
        );
        // The connection stays usable.
        assert_eq!(client.wait(context::current(), 1).await.expect("served"), 1);
    }
}
