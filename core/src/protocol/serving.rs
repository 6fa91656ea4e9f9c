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

/// Serves every request of `channel` with `serve` until the connection closes. Those
/// for which `inline` is true run in this task; the others go to `spawn` (which starts
/// `request.execute(serve)` in a task of its own).
pub async fn serve_connection<C, S>(
    channel: C,
    serve: S,
    inline: fn(&C::Req) -> bool,
    spawn: impl Fn(InFlightRequest<C::Req, C::Resp>, S),
) where
    C: Channel,
    C::Req: RequestName,
    S: Serve<Req = C::Req, Resp = C::Resp> + Clone,
{
    let mut requests = std::pin::pin!(channel.requests());
    while let Some(next) = requests.next().await {
        let request = match next {
            Ok(request) => request,
            Err(error) => {
                tracing::debug!(%error, "connection closed on a channel error");
                break;
            }
        };
        if inline(&request.get().message) {
            request.execute(serve.clone()).await;
        } else {
            spawn(request, serve.clone());
        }
    }
}
