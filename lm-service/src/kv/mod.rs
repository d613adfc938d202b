//! KV block bookkeeping: which block ids exist and which sequence holds which. No tensors here;
//! the tensors live in the runner's `PagedKvCache`, addressed by these ids.
pub mod block_pool;
pub mod manager;

pub use block_pool::BlockPool;
pub use manager::{Blocks, KvManager, SeqId};
