//! The admin side of `sluice pace` (SPEC C1): `GET /limits` (the effective
//! limits as JSON), `PUT /limits/<provider>` (edit and persist one
//! provider's limits), `GET /status` (counters) and the settings page at
//! `/` that shows and edits each provider's limits.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use http::StatusCode;
use sluice_core::Clock;
use sluice_store::BudgetStore;

use super::App;
use super::forward::envelope;
use crate::config::ProviderLimits;

pub(super) fn router<S: BudgetStore + 'static, C: Clock + 'static>(
    app: Arc<App<S, C>>,
) -> axum::Router {
    axum::Router::new()
        .route("/", get(page::<S, C>))
        .route("/limits", get(limits::<S, C>))
        .route(
            "/limits/{provider}",
            get(one::<S, C>).put(save::<S, C>).post(save::<S, C>),
        )
        .route("/status", get(status::<S, C>))
        .with_state(app)
}

async fn limits<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
) -> Json<serde_json::Value> {
    Json(app.pacer.limits_json())
}

fn not_found(provider: &str) -> Response {
    envelope(
        StatusCode::NOT_FOUND,
        &serde_json::json!({"error": {"code": "unknown_provider",
            "message": format!("no provider `{provider}` in the pace config"),
            "details": {"provider": provider}}}),
        None,
    )
}

async fn one<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
    Path(provider): Path<String>,
) -> Response {
    let all = app.pacer.limits_json();
    match all.get("providers").and_then(|p| p.get(&provider)) {
        Some(v) => Json(v.clone()).into_response(),
        None => not_found(&provider),
    }
}

fn bad_request(message: String) -> Response {
    envelope(
        StatusCode::BAD_REQUEST,
        &serde_json::json!({"error": {"code": "invalid_limits", "message": message, "details": {}}}),
        None,
    )
}

async fn save<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
    Path(provider): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return bad_request("expected a JSON object {\"tpm\": …, \"rpm\": …, \"rpd\": …}".into());
    };
    let config = app.pacer.config();
    let Some(current) = config.provider(&provider).map(|p| p.limits) else {
        return not_found(&provider);
    };
    let axis = |name: &str, old: u32| -> Result<u32, String> {
        match v.get(name) {
            None => Ok(old),
            Some(x) => x
                .as_u64()
                .or_else(|| x.as_str().and_then(|s| s.trim().parse().ok()))
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    format!(
                        "{name}: expected a whole number from 0 (unlimited) to {}",
                        u32::MAX
                    )
                }),
        }
    };
    let limits = match (|| {
        Ok::<_, String>(ProviderLimits {
            tpm: axis("tpm", current.tpm)?,
            rpm: axis("rpm", current.rpm)?,
            rpd: axis("rpd", current.rpd)?,
        })
    })() {
        Ok(l) => l,
        Err(m) => return bad_request(m),
    };
    if let Err(e) = app.pacer.source().save_limits(&provider, limits) {
        return envelope(
            StatusCode::INTERNAL_SERVER_ERROR,
            &serde_json::json!({"error": {"code": "not_saved", "message": e.to_string(), "details": {}}}),
            None,
        );
    }
    one(State(app), Path(provider)).await
}

async fn status<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
) -> Json<serde_json::Value> {
    let config = app.pacer.config();
    let providers: serde_json::Map<String, serde_json::Value> = config
        .providers
        .keys()
        .map(|name| (name.clone(), serde_json::json!(app.pacer.stats(name))))
        .collect();
    Json(serde_json::json!({
        "configFile": app.config_file.display().to_string(),
        "configError": app.pacer.source().last_error(),
        "providers": providers,
    }))
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

async fn page<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
) -> Html<String> {
    let config = app.pacer.config();
    let mut rows = String::new();
    for p in config.providers.values() {
        let n = escape(&p.name);
        let s = app.pacer.stats(&p.name);
        let _ = writeln!(
            rows,
            "<tr data-provider=\"{n}\"><th scope=row>{n}</th><td class=url>{url}</td>\
             <td><input name=tpm type=number min=0 value=\"{tpm}\" aria-label=\"{n} TPM\"></td>\
             <td><input name=rpm type=number min=0 value=\"{rpm}\" aria-label=\"{n} RPM\"></td>\
             <td><input name=rpd type=number min=0 value=\"{rpd}\" aria-label=\"{n} RPD\"></td>\
             <td class=src>{src:?}</td><td class=num>{adm}</td><td class=num>{w}</td>\
             <td><button type=button onclick=\"save(this)\">Save</button></td></tr>",
            url = escape(&p.base_url),
            tpm = p.limits.tpm,
            rpm = p.limits.rpm,
            rpd = p.limits.rpd,
            src = p.origin,
            adm = s.admitted,
            w = s.waited,
        );
    }
    let error = app
        .pacer
        .source()
        .last_error()
        .map(|e| format!("<p class=err>The config file has an error; the last good config is in force:<br><code>{}</code></p>", escape(&e)))
        .unwrap_or_default();
    Html(
        PAGE.replace("{{rows}}", &rows)
            .replace("{{error}}", &error)
            .replace("{{file}}", &escape(&app.config_file.display().to_string())),
    )
}

const PAGE: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sluice pace · Providers</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:15px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:68rem;padding:0 1rem;color:#1d2330}
h1{font-size:1.4rem;margin:0 0 .3rem} p.lead{color:#555;margin:.2rem 0 1.2rem}
table{border-collapse:collapse;width:100%} th,td{padding:.45rem .5rem;border-bottom:1px solid #e3e6ec;text-align:left}
thead th{font-size:.8rem;text-transform:uppercase;letter-spacing:.04em;color:#667}
td.url{font-family:ui-monospace,monospace;font-size:.85rem;color:#456} td.num{text-align:right}
input{width:7.5rem;padding:.25rem .35rem;font:inherit} button{padding:.3rem .8rem;font:inherit;cursor:pointer}
.err{color:#a11;background:#fdecec;padding:.6rem;border-radius:4px} #msg{min-height:1.4em}
.ok{color:#176d2c} .bad{color:#a11}
</style></head><body>
<h1>Settings → Providers</h1>
<p class="lead">Rate limits per provider: tokens per minute, requests per minute, requests per day (0 = unlimited).
Changes apply to the next request, without a restart, and are saved next to <code>{{file}}</code>.</p>
{{error}}
<table><thead><tr><th>Provider</th><th>Base URL</th><th>TPM</th><th>RPM</th><th>RPD</th><th>Source</th><th>Sent</th><th>Waited</th><th></th></tr></thead>
<tbody>
{{rows}}</tbody></table>
<p id="msg" role="status"></p>
<script>
async function save(button) {
  const row = button.closest('tr');
  const name = row.dataset.provider;
  const body = {};
  for (const k of ['tpm', 'rpm', 'rpd']) body[k] = Number(row.querySelector(`input[name=${k}]`).value);
  const msg = document.getElementById('msg');
  const r = await fetch('limits/' + encodeURIComponent(name), {method: 'PUT', headers: {'content-type': 'application/json'}, body: JSON.stringify(body)});
  const j = await r.json();
  if (r.ok) { msg.className = 'ok'; msg.textContent = `${name}: saved (TPM ${j.tpm}, RPM ${j.rpm}, RPD ${j.rpd}).`; row.querySelector('.src').textContent = 'Settings'; }
  else { msg.className = 'bad'; msg.textContent = `${name}: ${j.error ? j.error.message : r.status}`; }
}
</script>
</body></html>
"#;
