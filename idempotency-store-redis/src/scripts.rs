//! The Lua scripts, one per operation, each a shared prelude followed by the operation.

use std::sync::LazyLock;

use crate::lua;

/// A store operation, each one Lua script run atomically on the server that owns the
/// record's slot. [`RedisStore::script`](crate::RedisStore::script) shows the script, for
/// auditing what runs against your server and for benchmarks that run it raw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// Insert an in-flight record unless a live one holds the key; else return that one.
    Reserve,
    /// Read the live record.
    Load,
    /// Extend the owner's lease (fenced).
    Renew,
    /// Store the owner's response (fenced).
    Finalize,
    /// Delete the owner's in-flight record (fenced).
    Release,
    /// Hand an in-flight record whose lease lapsed to a new token (fenced).
    TakeOver,
    /// Read the live record as an operator sees it: no headers, no body.
    Inspect,
    /// Delete the live record on an operator's order.
    Evict,
}

impl Operation {
    /// Every operation, in the order of the record's life.
    pub const ALL: [Operation; 8] = [
        Operation::Reserve,
        Operation::Load,
        Operation::Renew,
        Operation::Finalize,
        Operation::Release,
        Operation::TakeOver,
        Operation::Inspect,
        Operation::Evict,
    ];

    /// The operation's name, as used in errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Reserve => "reserve",
            Operation::Load => "load",
            Operation::Renew => "renew",
            Operation::Finalize => "finalize",
            Operation::Release => "release",
            Operation::TakeOver => "take_over",
            Operation::Inspect => "inspect",
            Operation::Evict => "evict",
        }
    }

    /// Whether the script may write (everything but load and inspect).
    pub(crate) fn writes(self) -> bool {
        !matches!(self, Operation::Load | Operation::Inspect)
    }

    pub(crate) fn script(self) -> &'static Script {
        let scripts = &*SCRIPTS;
        match self {
            Operation::Reserve => &scripts[0],
            Operation::Load => &scripts[1],
            Operation::Renew => &scripts[2],
            Operation::Finalize => &scripts[3],
            Operation::Release => &scripts[4],
            Operation::TakeOver => &scripts[5],
            Operation::Inspect => &scripts[6],
            Operation::Evict => &scripts[7],
        }
    }
}

/// One script: its source and the SHA-1 that `EVALSHA` names it by.
#[derive(Debug)]
pub struct Script {
    source: String,
    sha1: String,
}

impl Script {
    fn new(operation: &str) -> Self {
        let source = format!("{}\n{operation}", lua::PRELUDE);
        let sha1 = redis::Script::new(&source).get_hash().to_owned();
        Self { source, sha1 }
    }

    /// The whole Lua source, prelude included, as sent with `EVAL`.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The SHA-1 of the source, as sent with `EVALSHA`.
    pub fn sha1(&self) -> &str {
        &self.sha1
    }
}

static SCRIPTS: LazyLock<[Script; 8]> = LazyLock::new(|| {
    [
        lua::RESERVE,
        lua::LOAD,
        lua::RENEW,
        lua::FINALIZE,
        lua::RELEASE,
        lua::TAKE_OVER,
        lua::INSPECT,
        lua::EVICT,
    ]
    .map(Script::new)
});
