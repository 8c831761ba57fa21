//! The gateway's side of the batch lane (sluice-batch's `lane` module): the lanes
//! over the gateway's limiter ([`AnyStore`]), sending items through a pool of
//! upstream connections of their own.

use std::sync::Arc;

use http::{Request, Response};
use sluice_batch::BatchQueue;
use sluice_batch::lane::{BatchUpstream, ItemBody, LaneHost};
use sluice_core::SystemClock;
use sluice_edge::SharedLimiter;

use crate::pool::{Connections, PooledBody, SendError, UpstreamPool, keep_pruned};
use crate::proxy::Upstream;
use crate::store::AnyStore;

/// One batch lane of the gateway: over its limiter, sending through its pool.
pub(crate) type BatchLane = sluice_batch::lane::BatchLane<AnyStore, UpstreamPool>;

/// The batch endpoints in front of the gateway's proxy `I`.
pub(crate) type BatchEndpoints<I> = sluice_batch::lane::BatchEndpoints<I, AnyStore, UpstreamPool>;

impl BatchUpstream for UpstreamPool {
    type Body = PooledBody;
    type Error = SendError;

    async fn send(&self, request: Request<ItemBody>) -> Result<Response<PooledBody>, SendError> {
        UpstreamPool::send(self, request).await
    }
}

/// The batch lanes of `shared`'s policy over `queue`, sending to `upstream` on
/// connections of their own (the pool the gateway's workers use, one shared by
/// every batch lane).
pub(crate) fn lanes(
    shared: &SharedLimiter<AnyStore>,
    queue: &Arc<dyn BatchQueue>,
    upstream: &Upstream,
    clock: &SystemClock,
) -> Vec<Arc<BatchLane>> {
    // Pruned by a task of this runtime, which the runners run on.
    let connections = Arc::new(Connections::to(upstream));
    keep_pruned(&connections);
    let host = LaneHost {
        upstream: UpstreamPool::new(connections),
        base_path: upstream.base_path().to_owned(),
        host_header: upstream.client_host(),
        peer_of: |parts| {
            parts
                .extensions
                .get::<sluice_tower::PeerAddr>()
                .map(|peer| peer.0)
        },
    };
    BatchLane::all(shared, queue, host, clock)
}
