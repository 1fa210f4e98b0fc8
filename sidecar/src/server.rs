//! Socket server (being written).
