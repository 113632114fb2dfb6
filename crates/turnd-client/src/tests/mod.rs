//! Unit tests of the SDK against a scripted fake server.

mod caller;
mod connection;
mod dial;
mod fake;
mod worker;
