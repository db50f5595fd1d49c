//! The memory budget: one bound on all the bytes the layer holds at once (request bodies,
//! which waiting duplicates hold too, and response bodies being read), so that hostile or
//! unlucky traffic cannot grow the process without limit.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget, shared by every clone of a layer's service.
#[derive(Debug)]
pub(crate) struct MemoryBudget {
    bytes: Arc<Semaphore>,
}

/// Bytes taken from the budget, given back when dropped.
#[derive(Debug, Default)]
pub(crate) struct Held {
    permit: Option<OwnedSemaphorePermit>,
}

impl MemoryBudget {
    pub(crate) fn new(bytes: usize) -> Self {
        Self {
            bytes: Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// Takes `bytes` more into `held`, if the budget has them.
    pub(crate) fn grow(&self, held: &mut Held, bytes: usize) -> bool {
        if bytes == 0 {
            return true;
        }
        let Ok(bytes) = u32::try_from(bytes) else {
            return false;
        };
        match self.bytes.clone().try_acquire_many_owned(bytes) {
            Ok(more) => {
                match &mut held.permit {
                    Some(permit) => permit.merge(more),
                    None => held.permit = Some(more),
                }
                true
            }
            Err(_) => false,
        }
    }
}

#[cfg(test)]
impl Held {
    /// How many bytes are held.
    pub(crate) fn bytes(&self) -> usize {
        self.permit
            .as_ref()
            .map_or(0, |permit| permit.num_permits())
    }
}
