//! One integration-test binary, one module per area.

mod architecture;
mod http;
mod postgres;
