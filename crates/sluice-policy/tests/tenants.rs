//! P4, tenants at run time: a [`TenantTable`] applied over a policy file's is
//! checked as a file is (every problem at its key path, nothing taken), adds and
//! revokes credentials, and moves workspaces between plans or gives them limits of
//! their own over their plan's.

use std::path::Path;

use sluice_policy::{
    Policy, TenantChange, TenantKey, TenantTable, TenantWorkspace, parse_str, raw::RawPlan,
    workspace_digest,
};

const KEY_A: &str = "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb";

fn policy() -> Policy {
    parse_str(
        "profile: p
profiles:
  p:
    classes: { search: 60, generate: 10 }
default_class: search
plans:
  pro:
    classes: { generate: 50 }
identity:
  keys:
    - { sha256: ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb, workspace: acme, user: ada }
",
        Path::new("tenants.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn put(name: &str, plan: Option<&str>, limits: RawPlan) -> TenantChange {
    TenantChange::PutWorkspace {
        name: name.to_owned(),
        workspace: TenantWorkspace {
            plan: plan.map(str::to_owned),
            limits,
        },
    }
}

#[test]
fn p4_a_workspace_moves_plan_and_takes_limits_of_its_own_over_its_plans() {
    let base = policy();
    let generate = base.class("generate").expect("a class");
    let search = base.class("search").expect("a class");
    let table = TenantTable::default().with(&put("acme", Some("pro"), RawPlan::default()), &base);
    let p = base.with_tenants(&table).expect("valid");
    let plan = p.plan_of(workspace_digest("acme")).expect("a plan");
    assert_eq!(plan.name, "pro");
    let mut limits = RawPlan::default();
    limits.classes.insert("search".to_owned(), 5);
    let table = table.with(&put("acme", Some("pro"), limits), &base);
    let p = base.with_tenants(&table).expect("valid");
    let own = p.plan_of(workspace_digest("acme")).expect("its own");
    assert_eq!(own.name, "pro+acme");
    assert_eq!(
        own.classes[search.index()].map(|l| l.get()),
        Some(5),
        "its own"
    );
    assert_eq!(
        own.classes[generate.index()].map(|l| l.get()),
        Some(50),
        "its plan's"
    );
}

#[test]
fn p4_a_revoked_credential_is_known_as_revoked_and_a_new_one_is_known() {
    let base = policy();
    let revoke = TenantChange::RevokeKey {
        sha256: KEY_A.to_uppercase(),
    };
    let table = TenantTable::default().with(&revoke, &base);
    let p = base.with_tenants(&table).expect("valid");
    let mut sha = [0u8; 32];
    hex::decode_to_slice(KEY_A, &mut sha).expect("hex");
    assert!(p.identity.revoked.contains(&sha) && !p.identity.keys.contains_key(&sha));
    // Removing a workspace revokes its credentials, the file's included.
    let removed = TenantTable::default().with(
        &TenantChange::RemoveWorkspace {
            name: "acme".to_owned(),
            revoked: None,
        },
        &base,
    );
    assert_eq!(removed.keys.get(KEY_A), Some(&None));
    // A workspace the admin API made and removed leaves nothing behind: creating and
    // removing workspaces does not grow the table.
    let mut churn = TenantTable::default();
    for i in 0..100 {
        let name = format!("temp{i}");
        churn = churn.with(&put(&name, Some("pro"), RawPlan::default()), &base);
        churn = churn.with(
            &TenantChange::RemoveWorkspace {
                name,
                revoked: None,
            },
            &base,
        );
    }
    assert!(
        churn.workspaces.is_empty() && churn.keys.is_empty(),
        "{churn:?}"
    );
    // Put back.
    let again = table.with(
        &TenantChange::PutKey {
            sha256: KEY_A.to_owned(),
            key: TenantKey {
                workspace: "globex".to_owned(),
                user: "bo".to_owned(),
            },
        },
        &base,
    );
    let p = base.with_tenants(&again).expect("valid");
    assert!(!p.identity.revoked.contains(&sha));
    assert_eq!(
        p.identity.keys.get(&sha).map(|k| k.workspace.as_str()),
        Some("globex")
    );
}

#[test]
fn p4_every_bad_change_is_named_by_its_key_path_and_nothing_is_taken() {
    let base = policy();
    let mut limits = RawPlan::default();
    limits.classes.insert("nope".to_owned(), 5);
    limits.classes.insert("generate".to_owned(), 0);
    limits.buckets.insert("exports".to_owned(), 5);
    let mut table = TenantTable::default();
    for change in [
        put("acme", Some("gold"), RawPlan::default()),
        put("globex", None, limits),
        put("key:abc", None, RawPlan::default()),
        TenantChange::RevokeKey {
            sha256: "abc".to_owned(),
        },
        TenantChange::PutKey {
            sha256: "9".repeat(64),
            key: TenantKey {
                workspace: " acme".to_owned(),
                user: "ada".to_owned(),
            },
        },
    ] {
        table = table.with(&change, &base);
    }
    let problems = base.with_tenants(&table).expect_err("refused");
    let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
    let text = text.join("\n");
    for expected in [
        "workspaces.acme.plan: no plan \"gold\" under `plans:` (declared: pro)",
        "workspaces.globex.limits.classes.nope: unknown class \"nope\"",
        "workspaces.globex.limits.classes.generate: must be at least 1",
        "workspaces.globex.limits.buckets.exports: no bucket \"exports\"",
        "workspaces.key:abc: expected 1 to 256 printable ASCII characters",
        "keys.abc: expected 64 hex digits",
        "keys.9999999999999999999999999999999999999999999999999999999999999999.workspace: expected 1 to 256 printable ASCII",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[test]
fn p4_a_change_applied_alone_over_the_running_policy_is_the_whole_table_over_the_file() {
    let base = policy();
    let mut limits = RawPlan::default();
    limits.classes.insert("search".to_owned(), 5);
    let changes = [
        put("acme", Some("pro"), RawPlan::default()),
        put("globex", None, limits.clone()),
        TenantChange::RevokeKey {
            sha256: KEY_A.to_owned(),
        },
        put("acme", Some("pro"), limits),
        TenantChange::RemoveWorkspace {
            name: "globex".to_owned(),
            revoked: None,
        },
    ];
    let mut table = TenantTable::default();
    let mut running = base.clone();
    for change in &changes {
        table = table.with(change, &base);
        running = running
            .with_tenants(&table.touched_by(change))
            .expect("valid");
        let whole = base.with_tenants(&table).expect("valid");
        for ws in ["acme", "globex", "initech"] {
            let d = workspace_digest(ws);
            assert_eq!(
                running.plan_of(d).map(|p| (&p.name, &p.classes)),
                whole.plan_of(d).map(|p| (&p.name, &p.classes)),
                "{ws} after {change:?}"
            );
        }
        assert_eq!(running.identity.keys, whole.identity.keys);
        assert_eq!(running.identity.revoked, whole.identity.revoked);
    }
}

/// A workspace removal names the credentials it revokes when it is made (each whose
/// workspace it is then, the table's entry over the file's): made again over a
/// policy file that gave the workspace a credential since (a journal read at
/// start, a replica with a newer file), it revokes those and no other; a file
/// credential the table moved to another workspace is not revoked with it.
#[test]
fn p4_a_kept_removal_revokes_what_it_revoked_when_made() {
    let base = policy();
    const KEY_B: &str = "3e23e8160039594a33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009d";
    const KEY_C: &str = "2e7d2c03a9507ae265ecf5b5356885a53393a2029d241394997265a1a25aefc6";
    // The file's acme key moved to globex; a key of the table's own for acme.
    let table = TenantTable::default()
        .with(
            &TenantChange::PutKey {
                sha256: KEY_A.to_owned(),
                key: TenantKey {
                    workspace: "globex".to_owned(),
                    user: "ada".to_owned(),
                },
            },
            &base,
        )
        .with(
            &TenantChange::PutKey {
                sha256: KEY_B.to_owned(),
                key: TenantKey {
                    workspace: "acme".to_owned(),
                    user: "bo".to_owned(),
                },
            },
            &base,
        );
    let asked = TenantChange::RemoveWorkspace {
        name: "acme".to_owned(),
        revoked: None,
    };
    let made = table.resolved(&asked, &base);
    assert_eq!(
        made,
        TenantChange::RemoveWorkspace {
            name: "acme".to_owned(),
            revoked: Some(vec![KEY_B.to_owned()]),
        }
    );
    let after = table.with(&made, &base);
    assert_eq!(
        after.keys.get(KEY_A),
        Some(&Some(TenantKey {
            workspace: "globex".to_owned(),
            user: "ada".to_owned(),
        })),
        "moved away before the removal: not revoked"
    );
    assert_eq!(after.keys.get(KEY_B), Some(&None));
    // The file later gives acme a new credential: the kept removal, made again over
    // it, leaves it valid.
    let newer = parse_str(
        &format!(
            "profile: p
profiles:
  p:
    classes: {{ search: 60, generate: 10 }}
default_class: search
plans:
  pro:
    classes: {{ generate: 50 }}
identity:
  keys:
    - {{ sha256: {KEY_A}, workspace: acme, user: ada }}
    - {{ sha256: {KEY_C}, workspace: acme, user: cy }}
"
        ),
        Path::new("tenants.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let replayed = table.with(&made, &newer);
    assert_eq!(
        replayed, after,
        "the same table, whatever the file says now"
    );
    let p = newer.with_tenants(&replayed).expect("valid");
    let mut c = [0u8; 32];
    hex::decode_to_slice(KEY_C, &mut c).expect("hex");
    assert!(p.identity.keys.contains_key(&c) && !p.identity.revoked.contains(&c));
    // Written and read back, the change is the one made.
    let json = serde_json::to_string(&made).expect("json");
    assert_eq!(
        serde_json::from_str::<TenantChange>(&json).expect("read"),
        made
    );
    // As the admin API asks it (no list), it reads as before.
    let asked_json = r#"{"op":"remove_workspace","name":"acme"}"#;
    assert_eq!(
        serde_json::from_str::<TenantChange>(asked_json).expect("read"),
        asked
    );
}

/// A replica following a shared table leaves out exactly the entries its policy
/// file cannot take, each named: a workspace whose name another's starts with,
/// before a dot (`team` of `team.eu`, `acme` of `acme.limits`), keeps its plan,
/// and so do the credentials beside a credential left out.
#[test]
fn p4_a_replica_leaves_out_exactly_the_entries_that_do_not_fit_whatever_their_names() {
    let base = policy();
    let mut unknown_class = RawPlan::default();
    unknown_class.classes.insert("nope".to_owned(), 5);
    const KEY_B: &str = "3e23e8160039594a33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009d";
    let key = |sha256: &str, workspace: &str| TenantChange::PutKey {
        sha256: sha256.to_owned(),
        key: TenantKey {
            workspace: workspace.to_owned(),
            user: "ada".to_owned(),
        },
    };
    let mut table = TenantTable::default();
    for change in [
        put("team", Some("pro"), RawPlan::default()),
        put("team.eu", Some("ent"), RawPlan::default()),
        put("team.eu.west", Some("pro"), RawPlan::default()),
        put("acme", Some("pro"), RawPlan::default()),
        put("acme.limits", None, unknown_class),
        key(KEY_A, "team"),
        key(KEY_B, " team"),
    ] {
        table = table.with(&change, &base);
    }
    let (p, left_out) = base
        .with_fitting_tenants(&table)
        .expect("the entries that fit are taken");
    let mut paths: Vec<&str> = left_out.iter().map(|p| p.path.as_str()).collect();
    paths.sort_unstable();
    assert_eq!(
        paths,
        [
            format!("keys.{KEY_B}.workspace").as_str(),
            "workspaces.acme.limits.limits.classes.nope",
            "workspaces.team.eu.plan",
        ],
        "each entry left out named once: {left_out:?}"
    );
    for kept in ["team", "team.eu.west", "acme"] {
        assert_eq!(
            p.plan_of(workspace_digest(kept)).map(|p| p.name.as_str()),
            Some("pro"),
            "{kept} fits and keeps its plan"
        );
    }
    for left in ["team.eu", "acme.limits"] {
        assert!(p.plan_of(workspace_digest(left)).is_none(), "{left}");
        assert!(!p.tenants.by_name.contains_key(left), "{left}");
    }
    let digest = |sha: &str| {
        let mut d = [0u8; 32];
        hex::decode_to_slice(sha, &mut d).expect("hex");
        d
    };
    assert_eq!(
        p.identity
            .keys
            .get(&digest(KEY_A))
            .map(|k| k.workspace.as_str()),
        Some("team")
    );
    assert!(!p.identity.keys.contains_key(&digest(KEY_B)));
}

/// Every workspace name a tenant table takes (1 to 256 printable ASCII) can
/// hold limits of its own: its plan is never checked as a plan name, its
/// problems are at `workspaces.<name>.limits…`, and it is named apart from
/// every plan of the file (a workspace named `pro` included).
#[test]
fn p4_any_workspace_name_can_hold_limits_of_its_own() {
    let base = policy();
    let generate = base.class("generate").expect("a class");
    let search = base.class("search").expect("a class");
    let mut limits = RawPlan::default();
    limits.classes.insert("search".to_owned(), 5);
    let long = "w".repeat(256);
    let names = [
        "team@corp",
        "team corp",
        "a;b",
        "a/b",
        "a+b",
        "pro",
        "own",
        &long[..65],
        long.as_str(),
    ];
    let mut table = TenantTable::default();
    for name in names {
        table = table.with(&put(name, Some("pro"), limits.clone()), &base);
    }
    let p = base
        .with_tenants(&table)
        .unwrap_or_else(|e| panic!("{e:?}"));
    for name in names {
        let own = p.plan_of(workspace_digest(name)).expect("its own");
        assert_eq!(own.name, format!("pro+{name}"));
        assert_eq!(own.classes[search.index()].map(|l| l.get()), Some(5));
        assert_eq!(own.classes[generate.index()].map(|l| l.get()), Some(50));
    }
    let pro = &p.plans[p.plan("pro").expect("the file's plan")];
    assert_eq!(
        pro.classes[search.index()],
        None,
        "the file's plan unchanged"
    );
    // A bad limit of its own is named at its key path.
    let mut bad = RawPlan::default();
    bad.classes.insert("search".to_owned(), 0);
    for name in ["team@corp", "own", long.as_str()] {
        let table = TenantTable::default().with(&put(name, None, bad.clone()), &base);
        let problems = base.with_tenants(&table).expect_err("refused");
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [format!("workspaces.{name}.limits.classes.search")],
            "{problems:?}"
        );
    }
}
