//! Auth, limits, hostile input, graceful shutdown, CI use of the binary.
