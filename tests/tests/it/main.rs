//! One integration-test binary, one module per area.

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock

mod architecture;
mod cleanup;
mod client;
mod consumer;
mod http;
mod once;
mod outbox;
mod payments_provider;
mod postgres;
mod provider;
