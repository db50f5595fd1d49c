//! The HTTP surface: the Iceberg REST catalog routes, each served with and without a
//! `{prefix}` segment, and handlers that turn path, query and body into a catalog call.
//!
//! A handler of a change gets it back from the catalog uncommitted, builds its answer,
//! and commits the change together with that answer, which goes into the request's
//! idempotency record in the same transaction (see [`crate::catalog`]).
//!
//! - [`request`]: what every handler shares (state, reservation, paths, body parsing).
//! - [`mod@config`], [`namespaces`], [`tables`], [`transactions`], [`views`]: the handlers,
//!   one file per resource, as the catalog is split.

mod config;
mod namespaces;
mod request;
mod tables;
mod transactions;
mod views;

use axum::Router;
use axum::routing::{MethodRouter, get, post};

use crate::catalog::CatalogDatabase;

pub(crate) use request::AppState;

use self::config::config;
use self::namespaces::{
    create_namespace, drop_namespace, list_namespaces, load_namespace, namespace_exists,
    update_properties,
};
use self::tables::{
    commit_table, create_table, drop_table, list_tables, load_table, register_table, rename_table,
    report_metrics, table_exists,
};
use self::transactions::commit_transaction;
use self::views::{
    create_view, drop_view, list_views, load_view, register_view, rename_view, replace_view,
    view_exists,
};

/// The whole API. Every catalog route is served at `/v1/...` (what the config response
/// implies, since it sets no `prefix`) and at `/v1/{prefix}/...` for clients configured
/// with one; the prefix is accepted and ignored.
pub(crate) fn router<DB: CatalogDatabase>(state: AppState<DB>) -> Router {
    let mut router = Router::new().route("/v1/config", get(config));
    for base in ["/v1", "/v1/{prefix}"] {
        for (path, handler) in catalog_routes::<DB>() {
            router = router.route(&format!("{base}{path}"), handler);
        }
    }
    router.with_state(state)
}

fn catalog_routes<DB: CatalogDatabase>() -> Vec<(&'static str, MethodRouter<AppState<DB>>)> {
    vec![
        (
            "/namespaces",
            get(list_namespaces::<DB>).post(create_namespace::<DB>),
        ),
        (
            "/namespaces/{namespace}",
            get(load_namespace::<DB>)
                .head(namespace_exists::<DB>)
                .delete(drop_namespace::<DB>),
        ),
        (
            "/namespaces/{namespace}/properties",
            post(update_properties::<DB>),
        ),
        (
            "/namespaces/{namespace}/tables",
            get(list_tables::<DB>).post(create_table::<DB>),
        ),
        (
            "/namespaces/{namespace}/tables/{table}",
            get(load_table::<DB>)
                .head(table_exists::<DB>)
                .post(commit_table::<DB>)
                .delete(drop_table::<DB>),
        ),
        (
            "/namespaces/{namespace}/tables/{table}/metrics",
            post(report_metrics),
        ),
        (
            "/namespaces/{namespace}/register",
            post(register_table::<DB>),
        ),
        ("/tables/rename", post(rename_table::<DB>)),
        ("/transactions/commit", post(commit_transaction::<DB>)),
        (
            "/namespaces/{namespace}/views",
            get(list_views::<DB>).post(create_view::<DB>),
        ),
        (
            "/namespaces/{namespace}/views/{view}",
            get(load_view::<DB>)
                .head(view_exists::<DB>)
                .post(replace_view::<DB>)
                .delete(drop_view::<DB>),
        ),
        ("/views/rename", post(rename_view::<DB>)),
        (
            "/namespaces/{namespace}/register-view",
            post(register_view::<DB>),
        ),
    ]
}
