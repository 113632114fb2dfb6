//! Durability: acknowledged writes survive SIGKILL of the real binary.
