//! A route's evaluation sets.

use super::*;
use lorafleet_admin_types::*;

fn show_sets(c: &Client, sets: &[EvalSetView]) {
    if c.output == Output::Json {
        println!("{}", as_json(&sets));
        return;
    }
    let rows: Vec<Vec<String>> = sets
        .iter()
        .map(|s| {
            vec![
                format!("{}@{}", s.name, s.version),
                s.items.to_string(),
                s.multiple_choice.to_string(),
                s.generation.to_string(),
                s.bytes.to_string(),
                s.sha256[..12.min(s.sha256.len())].to_owned(),
                s.created_by.clone(),
                s.created_at.to_rfc3339(),
            ]
        })
        .collect();
    table(
        &[
            "set", "items", "choice", "generate", "bytes", "sha256", "by", "at",
        ],
        &rows,
    );
}

pub(crate) async fn evals(c: &Client, cmd: EvalCmd) -> Result<(), Failure> {
    match cmd {
        EvalCmd::Register {
            tenant,
            model,
            file,
            name,
        } => {
            let jsonl = std::fs::read_to_string(&file)
                .map_err(|e| fail(USAGE, format!("{}: {e}", file.display())))?;
            let name = match name {
                Some(n) => n,
                None => file
                    .file_stem()
                    .map(|s| s.to_string_lossy().to_lowercase())
                    .ok_or_else(|| fail(USAGE, "--name: give the set a name"))?,
            };
            let path = format!("{}/evals", route_path(&tenant, &model));
            let set: EvalSetView = c.post_as(&path, &NewEvalSet { name, jsonl }).await?;
            if c.output == Output::Json {
                println!("{}", as_json(&set));
            } else {
                show_sets(c, std::slice::from_ref(&set));
            }
        }
        EvalCmd::List { tenant, model } => {
            let path = format!("{}/evals", route_path(&tenant, &model));
            let list: EvalSetList = c.get_as(&path, &[]).await?;
            show_sets(c, &list.sets);
        }
    }
    Ok(())
}
