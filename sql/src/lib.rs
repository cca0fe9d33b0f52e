//! What fenced's SQL backends share.
