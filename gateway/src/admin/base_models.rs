//! Base models: register and list.

use super::*;

/// Every base model.
#[derive(Debug)]
pub struct ListBaseModels;

impl Query for ListBaseModels {
    type Output = BaseModelList;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<BaseModelList, AdminError> {
        let base_models: Vec<BaseModelRow> = sqlx::query_as(
            "SELECT name, architecture, base_hash, created_at FROM base_models ORDER BY name",
        )
        .fetch_all(&s.pool)
        .await
        .map_err(db_error)?;
        Ok(BaseModelList { base_models })
    }
}

pub(super) fn check_model_name(name: &str, param: &str) -> Result<(), AdminError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:/-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(AdminError::field(
            param,
            format!(
                "{name:?} must be 1-128 characters of letters, digits and . _ : / -, starting with a letter or digit"
            ),
        ))
    }
}

/// A base model registered by name, architecture and base hash.
#[derive(Debug)]
pub struct RegisterBaseModel(pub NewBaseModel);

impl Command for RegisterBaseModel {
    type Output = BaseModelRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<BaseModelRow, AdminError> {
        let b = self.0;
        check_model_name(&b.name, "name")?;
        if Architecture::from_model_type(&b.architecture).is_none() {
            let known: Vec<&str> = Architecture::ALL.iter().map(|a| a.model_type()).collect();
            return Err(AdminError::field(
                "architecture",
                format!(
                    "{:?} is not supported; expected one of {}",
                    b.architecture,
                    known.join(", ")
                ),
            ));
        }
        if !(b.base_hash.len() == 64
            && b.base_hash
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)))
        {
            return Err(AdminError::field(
                "base_hash",
                "must be 64 lowercase hex digits (lorafleetctl base-models hash DIR computes it)",
            ));
        }
        let row: BaseModelRow = sqlx::query_as(
            "INSERT INTO base_models (name, architecture, base_hash) VALUES ($1, $2, $3)
         RETURNING name, architecture, base_hash, created_at",
        )
        .bind(&b.name)
        .bind(&b.architecture)
        .bind(&b.base_hash)
        .fetch_one(cx.db().await?)
        .await
        .map_err(db_error)?;
        cx.record(
            "base_model.register",
            ("base_model", &row.name),
            None,
            Some(to_json(&row)),
        );
        Ok(row)
    }
}
