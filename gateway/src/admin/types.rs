//! The admin API's request and response bodies: `lorafleet-admin-types`,
//! shared with `lorafleetctl`.

pub use lorafleet_admin_types::*;
