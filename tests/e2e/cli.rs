//! The turnd command line against a real daemon.
