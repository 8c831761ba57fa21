//! The admin side of `sluice pace`: `GET /limits` (the effective
//! limits as JSON), `PUT /limits/<provider>` (edit and persist one
//! provider's limits), `GET /status` (counters), `GET /dashboard.json` (limits,
//! windows and counters in one answer) and the settings page at `/`: per
//! provider, tokens and requests in the current windows against the limits,
//! waits, 429s avoided, and a form that edits the limits — live (it polls
//! `dashboard.json` every second), with no external assets.

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
        .route("/dashboard.json", get(dashboard_json::<S, C>))
        .with_state(app)
}

async fn limits<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
) -> Json<serde_json::Value> {
    Json(app.pacer.limits_json().await)
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
    let all = app.pacer.limits_json().await;
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
    entrant: Option<axum::Extension<sluice_door::Entrant>>,
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
    // Each axis the body names (the others stay as they are when the edit is
    // made, not as they were when this request came: two edits at once both
    // hold).
    let axis = |name: &str| -> Result<Option<u32>, String> {
        match v.get(name) {
            None => Ok(None),
            Some(x) => x
                .as_u64()
                .or_else(|| x.as_str().and_then(|s| s.trim().parse().ok()))
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    format!(
                        "{name}: expected a whole number from 0 (unlimited) to {}",
                        u32::MAX
                    )
                }),
        }
    };
    let named = match (|| {
        Ok::<_, String>([
            axis("tpm")?,
            axis("rpm")?,
            axis("rpd")?,
            axis("itpm")?,
            axis("otpm")?,
            axis("tpd")?,
        ])
    })() {
        Ok(n) => n,
        Err(m) => return bad_request(m),
    };
    let [tpm, rpm, rpd, itpm, otpm, tpd] = named;
    let edit = |c: ProviderLimits| {
        ProviderLimits::new(
            tpm.unwrap_or(c.tpm),
            rpm.unwrap_or(c.rpm),
            rpd.unwrap_or(c.rpd),
        )
        .with_io(itpm.unwrap_or(c.itpm), otpm.unwrap_or(c.otpm))
        .with_tpd(tpd.unwrap_or(c.tpd))
    };
    let limits = match app.pacer.source().edit_limits(&provider, &edit) {
        Ok(limits) => limits,
        Err(e) => {
            return envelope(
                StatusCode::INTERNAL_SERVER_ERROR,
                &serde_json::json!({"error": {"code": "not_saved", "message": e.to_string(), "details": {}}}),
                None,
            );
        }
    };
    let show = |l: ProviderLimits| {
        format!(
            "tpm={} rpm={} rpd={} itpm={} otpm={} tpd={}",
            l.tpm, l.rpm, l.rpd, l.itpm, l.otpm, l.tpd
        )
    };
    tracing::info!(
        target: "sluice::audit",
        who = %entrant.map_or_else(|| "unknown".to_owned(), |e| e.0.to_string()),
        what = "pace limits",
        provider = %provider,
        before = %show(current),
        after = %show(limits),
        "admin change"
    );
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

/// `GET /dashboard.json`: `/limits` plus, per provider, `window` (see
/// [`crate::WindowReading`]: `tokens`, `requestsLastMinute`, `requestsToday`; or
/// `{"error"}` when the books cannot be read) and `configFile`.
async fn dashboard_json<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
) -> Response {
    let mut v = app.pacer.limits_json().await;
    if let Some(map) = v.get_mut("providers").and_then(|m| m.as_object_mut()) {
        for (name, entry) in map.iter_mut() {
            let mut window = match app.pacer.reading(name).await {
                Ok(r) => serde_json::json!(r),
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            };
            // The provider-wide input and output windows (ITPM / OTPM).
            if let (Ok((_, input, output)), Some(w)) = (
                app.pacer.group_tokens(name, None).await,
                window.as_object_mut(),
            ) {
                w.insert("inputTokens".into(), input.into());
                w.insert("outputTokens".into(), output.into());
            }
            if let Some(obj) = entry.as_object_mut() {
                obj.insert("window".into(), window);
            }
            // Per model group: tokens in its own windows.
            let groups: Vec<String> = entry
                .get("models")
                .and_then(|m| m.as_object())
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            for group in groups {
                let window = match app.pacer.group_tokens(name, Some(&group)).await {
                    Ok((tokens, input, output)) => {
                        serde_json::json!({"tokens": tokens, "inputTokens": input, "outputTokens": output})
                    }
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                };
                if let Some(m) = entry
                    .pointer_mut(&format!(
                        "/models/{}",
                        group.replace('~', "~0").replace('/', "~1")
                    ))
                    .and_then(|m| m.as_object_mut())
                {
                    m.insert("window".into(), window);
                }
            }
        }
    }
    if let Some(obj) = v.as_object_mut() {
        obj.insert(
            "configFile".into(),
            app.config_file.display().to_string().into(),
        );
    }
    ([(http::header::CACHE_CONTROL, "no-store")], Json(v)).into_response()
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

/// A limit as the page shows it (0 = unlimited).
fn shown(n: u32) -> String {
    if n == 0 {
        "–".to_owned()
    } else {
        n.to_string()
    }
}

/// The provider's per-model limits (`models:`), one row per budget.
fn models_table(p: &crate::config::ProviderConfig) -> String {
    if p.models.is_empty() {
        return String::new();
    }
    let mut groups: Vec<(&str, Vec<&str>, crate::config::ProviderLimits)> = Vec::new();
    for m in &p.models {
        match groups.iter_mut().find(|g| g.0 == m.group) {
            Some(g) => g.1.push(&m.pattern),
            None => groups.push((&m.group, vec![&m.pattern], m.limits)),
        }
    }
    let mut rows = String::new();
    for (group, patterns, l) in groups {
        let _ = write!(
            rows,
            "<tr data-group=\"{g}\"><td>{pats}</td><td>{tpm}</td><td>{rpm}</td><td>{rpd}</td>\
             <td>{itpm}</td><td>{otpm}</td><td>{tpd}</td><td class=used>–</td></tr>",
            g = escape(group),
            pats = patterns
                .iter()
                .map(|p| escape(p))
                .collect::<Vec<_>>()
                .join(", "),
            tpm = shown(l.tpm),
            rpm = shown(l.rpm),
            rpd = shown(l.rpd),
            itpm = shown(l.itpm),
            otpm = shown(l.otpm),
            tpd = shown(l.tpd),
        );
    }
    format!(
        "<table class=models><caption>Per-model limits (besides the provider's)</caption>\
         <tr><th>models</th><th>TPM</th><th>RPM</th><th>RPD</th><th>ITPM</th><th>OTPM</th>\
         <th>TPD</th><th>tokens, last 60 s</th></tr>{rows}</table>"
    )
}

/// The provider's keys (`apiKeys:`) by name and limits — never the key.
fn keys_table(p: &crate::config::ProviderConfig) -> String {
    if p.api_keys.is_empty() {
        return String::new();
    }
    let mut rows = String::new();
    for k in &p.api_keys {
        let l = k.limits;
        let _ = write!(
            rows,
            "<tr><td>{name}</td><td>{tpm}</td><td>{rpm}</td><td>{rpd}</td><td>{itpm}</td><td>{otpm}</td><td>{tpd}</td></tr>",
            name = escape(&k.name),
            tpm = shown(l.tpm),
            rpm = shown(l.rpm),
            rpd = shown(l.rpd),
            itpm = shown(l.itpm),
            otpm = shown(l.otpm),
            tpd = shown(l.tpd),
        );
    }
    format!(
        "<table class=keys><caption>Keys (each with its own limits)</caption>\
         <tr><th>key</th><th>TPM</th><th>RPM</th><th>RPD</th><th>ITPM</th><th>OTPM</th><th>TPD</th></tr>{rows}</table>"
    )
}

/// What the pacer learned of the provider's input count, per model (its
/// input ratios: see `docs/pacer.md`); the page refreshes the rows.
fn ratios_table(ratios: &[crate::InputRatioReading]) -> String {
    let mut rows = String::new();
    for r in ratios {
        let model = match r.model.as_str() {
            "" => "(no model named)".to_owned(),
            "\0other" => "(other models)".to_owned(),
            m => escape(m),
        };
        let _ = write!(
            rows,
            "<tr><td>{model}</td><td>{ratio:.3}</td><td>{factor:.3}</td><td>{samples}</td></tr>",
            ratio = r.ratio,
            factor = r.factor,
            samples = r.samples,
        );
    }
    let empty = if ratios.is_empty() { "" } else { " hidden" };
    format!(
        "<table class=ratios><caption>Learned input ratios (the provider's count ÷ the estimate;          kept across restarts)</caption><thead><tr><th>model</th><th>ratio</th>         <th>reserved ×</th><th>answers</th></tr></thead><tbody>{rows}</tbody></table>         <p class=\"hint none\"{empty}>No answer has reported its input tokens yet.</p>"
    )
}

async fn page<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
) -> Response {
    let config = app.pacer.config();
    let mut cards = String::new();
    for p in config.providers.values() {
        let n = escape(&p.name);
        let meter = |axis: &str, label: &str| {
            format!(
                "<div class=meter data-axis={axis}><div class=mtop><span>{label}</span>\
                 <span class=v>–</span></div><div class=bar><span></span></div></div>"
            )
        };
        let stat = |key: &str, label: &str| {
            format!("<div class=stat data-stat={key}><b>–</b><span>{label}</span></div>")
        };
        let input = |axis: &str, label: &str, value: u32| {
            format!(
                "<label>{label}<input name={axis} type=number min=0 step=1 inputmode=numeric \
                 value=\"{value}\" aria-label=\"{n} {label}\"></label>"
            )
        };
        let _ = writeln!(
            cards,
            "<section class=card data-provider=\"{n}\">\
             <div class=head><h2>{n}</h2><span class=\"badge src\">{src}</span>\
             <span class=\"badge hold\" hidden></span></div>\
             <div class=url>{url}</div>\
             <div class=meters>{m1}{m2}{m3}{m4}{m5}</div>\
             <div class=stats>{s1}{s2}{s3}{s4}{s5}</div>{models}{keys}{ratios}\
             <form class=settings><div class=inputs>{i1}{i2}{i3}{i4}{i5}{i6}</div>\
             <button>Save</button><p class=msg role=status></p></form></section>",
            url = escape(&p.base_url),
            src = escape(
                serde_json::to_value(p.origin)
                    .ok()
                    .as_ref()
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("")
            ),
            m1 = meter("tpm", "Tokens, last 60 s"),
            m2 = meter("rpm", "Requests, last 60 s"),
            m3 = meter("rpd", "Requests, last 24 h"),
            m4 = if p.limits.itpm > 0 {
                meter("itpm", "Input tokens, last 60 s")
            } else {
                String::new()
            },
            m5 = if p.limits.otpm > 0 {
                meter("otpm", "Output tokens, last 60 s")
            } else {
                String::new()
            },
            s1 = stat("admitted", "sent"),
            s2 = stat("avoided", "429s avoided"),
            s3 = stat("wait", "average wait"),
            s4 = stat("upstream429", "429s from the provider"),
            s5 = stat("retries", "retries"),
            i1 = input("tpm", "TPM", p.limits.tpm),
            i2 = input("rpm", "RPM", p.limits.rpm),
            i3 = input("rpd", "RPD", p.limits.rpd),
            i4 = input("itpm", "ITPM", p.limits.itpm),
            i5 = input("otpm", "OTPM", p.limits.otpm),
            i6 = input("tpd", "TPD", p.limits.tpd),
            ratios = ratios_table(&app.pacer.input_ratios(&p.name)),
            models = models_table(p),
            keys = keys_table(p),
        );
    }
    let error = app
        .pacer
        .source()
        .last_error()
        .map(|e| format!("<p class=err>The config file has an error; the last good config is in force:<br><code>{}</code></p>", escape(&e)))
        .unwrap_or_default();
    let html = PAGE
        .replace("{{cards}}", &cards)
        .replace("{{error}}", &error)
        .replace("{{file}}", &escape(&app.config_file.display().to_string()));
    (
        [
            (http::header::CACHE_CONTROL, "no-store"),
            (
                http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; base-uri 'none'; form-action 'none'",
            ),
        ],
        Html(html),
    )
        .into_response()
}

/// The settings page (see the module's docs); `{{cards}}`, `{{error}}` and
/// `{{file}}` are filled in, escaped, when it is served.
const PAGE: &str = include_str!("settings.html");
