//! The hot connections of this backend: [`fenced_sql::Conns`] (a small cache
//! in front of the sqlx pool, reused without the pool's ping per checkout
//! and return) with this backend's view of which errors end a session.

use crate::error::MySqlBackend;

/// Hot connections in autocommit mode with the server's default session.
pub(crate) type Conns = fenced_sql::Conns<MySqlBackend>;

/// A connection taken from [`Conns`].
pub(crate) type Conn<'a> = fenced_sql::Conn<'a, MySqlBackend>;
