//! What operators see: wait states, inspect, stats, events, watch, metrics.
