//! KV block bookkeeping: which block ids exist, which sequence holds which, and which full
//! blocks hold content that a later sequence with the same prefix can reuse. No tensors here;
//! the tensors live in the LM backend's paged KV cache, addressed by these ids.
pub mod block_pool;
pub mod manager;
pub mod prefix;

pub use block_pool::{BlockKey, BlockPool};
pub use manager::{Blocks, KvManager, SeqId};
pub use prefix::{ImageSpan, KeyChain};
