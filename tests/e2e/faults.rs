//! Truthful terminal states under storage faults, and store.check.
