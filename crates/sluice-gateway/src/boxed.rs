//! The error type of the gateway's streamed bodies, in a file of its own so that the
//! proxy, its upstream pool and its upload bodies all import it from here (the proxy
//! uses the pool and the uploads; they use nothing of the proxy).

/// The error type of streamed bodies.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
