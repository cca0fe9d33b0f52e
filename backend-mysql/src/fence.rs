#![doc = include_str!("../docs/fence.md")]

use fenced_api::Error;

use crate::error;

pub use fenced_sql::fence::{FenceOutcome, DEFAULT_FENCE_TABLE};

/// The fence table and its statements, on MySQL / MariaDB. Cheap to clone;
/// holds no connection. The shared implementation
/// ([`fenced_sql::fence::Fence`]) with this crate's error mapping.
pub type Fence = fenced_sql::fence::Fence<MySqlBackend>;

/// How the shared SQL code (`fenced_sql`: the fence, the migration runner)
/// sees this backend: MySQL, with this crate's error mapping.
#[derive(Debug, Clone, Copy)]
pub struct MySqlBackend;

/// ER_BAD_FIELD_ERROR: unknown column.
const ER_BAD_FIELD: u16 = 1054;

impl fenced_sql::SqlBackend for MySqlBackend {
    type Db = sqlx::MySql;
    const BACKEND: &'static str = error::BACKEND;
    fn map(e: sqlx::Error) -> Error {
        error::map(e)
    }
    fn is_missing_table(e: &sqlx::Error) -> bool {
        error::number(e) == Some(error::code::NO_SUCH_TABLE)
    }
    fn is_missing_column(e: &sqlx::Error) -> bool {
        error::number(e) == Some(ER_BAD_FIELD)
    }
}
