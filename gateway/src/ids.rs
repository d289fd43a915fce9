//! The registry's ids, one type each, so a tenant's id is never passed
//! where a route's is expected. Each is the row's UUID; the database and
//! the spool see the bare UUID (`sqlx` and `serde` transparent).

use uuid::Uuid;

macro_rules! uuid_ids {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            serde::Serialize, serde::Deserialize, sqlx::Type,
        )]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// The row's UUID.
            pub fn get(self) -> Uuid {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    )*};
}

uuid_ids! {
    /// A `tenants.id`.
    TenantId;
    /// An `api_keys.id`.
    KeyId;
    /// A `routes.id`.
    RouteId;
    /// A `rollouts.id`.
    RolloutId;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_travel_as_bare_uuids() {
        let u = Uuid::from_u128(7);
        let t = TenantId(u);
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            serde_json::to_string(&u).unwrap()
        );
        assert_eq!(
            serde_json::from_str::<TenantId>(&serde_json::to_string(&u).unwrap()).unwrap(),
            t
        );
        assert_eq!(t.to_string(), u.to_string());
        assert_eq!(RouteId(u).get(), u);
    }
}
