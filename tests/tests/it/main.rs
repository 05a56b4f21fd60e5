//! One integration-test binary, one module per area.

mod architecture;
mod cleanup;
mod client;
mod consumer;
mod http;
mod outbox;
mod postgres;
