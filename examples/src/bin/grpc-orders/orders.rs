//! The `orders.v1.Orders` service over a SQL table of orders.

use std::pin::Pin;
use std::time::Duration;

use futures_util::Stream;
use sqlx::AnyPool;
use tonic::{Request, Response, Status};

mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("orders.v1");
}

pub(crate) use pb::orders_server::OrdersServer;
use pb::{CreateOrderRequest, ListOrdersRequest, Order, PlaceOrderRequest};

/// The serialized file descriptor set of `orders.proto`: it tells the idempotency layer
/// that `ListOrders` streams.
pub(crate) const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/orders_descriptor.bin"));

/// The caller's tenant, as [`authenticate`] found it.
#[derive(Clone, Debug)]
pub(crate) struct Tenant(pub(crate) String);

/// The service's authentication, run as a tower layer outside the idempotency layer:
/// `authorization: Bearer <tenant>` names the tenant (this example trusts it; a real
/// service verifies a token here), no `authorization` is the tenant `anonymous`, and any
/// other `authorization` is refused.
pub(crate) fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let tenant = match request.metadata().get("authorization") {
        None => "anonymous".to_owned(),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|value| value.strip_prefix("Bearer "))
            .filter(|tenant| !tenant.is_empty())
            .ok_or_else(|| Status::unauthenticated("send authorization: Bearer <tenant>"))?
            .to_owned(),
    };
    request.extensions_mut().insert(Tenant(tenant));
    Ok(request)
}

/// The orders table, in any of the three databases.
#[derive(Clone)]
pub(crate) struct Database {
    pool: AnyPool,
    table: String,
    /// PostgreSQL numbers its placeholders; MySQL and SQLite take `?`.
    numbered: bool,
}

impl Database {
    pub(crate) async fn open(url: &str, table: &str) -> Result<Self, sqlx::Error> {
        sqlx::any::install_default_drivers();
        let pool = AnyPool::connect(url).await?;
        let database = Self {
            pool,
            table: table.to_owned(),
            numbered: url.starts_with("postgres"),
        };
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {table} (id BIGINT NOT NULL PRIMARY KEY, item TEXT NOT NULL)"
        );
        // Replicas starting together may race on CREATE TABLE IF NOT EXISTS (PostgreSQL):
        // the loser tries once more and then finds the table.
        if sqlx::query(&create).execute(&database.pool).await.is_err() {
            sqlx::query(&create).execute(&database.pool).await?;
        }
        Ok(database)
    }

    /// Appends an order with the next id. Replicas may race for an id: the primary key
    /// refuses the second insert, and it takes the next one.
    async fn insert(&self, item: &str) -> Result<Order, sqlx::Error> {
        let table = &self.table;
        let insert = if self.numbered {
            format!("INSERT INTO {table} (id, item) VALUES ($1, $2)")
        } else {
            format!("INSERT INTO {table} (id, item) VALUES (?, ?)")
        };
        let mut attempts = 0;
        loop {
            let next: i64 =
                sqlx::query_scalar(&format!("SELECT COALESCE(MAX(id), 0) + 1 FROM {table}"))
                    .fetch_one(&self.pool)
                    .await?;
            match sqlx::query(&insert)
                .bind(next)
                .bind(item)
                .execute(&self.pool)
                .await
            {
                Ok(_) => {
                    return Ok(Order {
                        id: next,
                        item: item.to_owned(),
                    });
                }
                Err(sqlx::Error::Database(error))
                    if error.is_unique_violation() && attempts < 20 =>
                {
                    attempts += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }

    async fn all(&self) -> Result<Vec<Order>, sqlx::Error> {
        let rows: Vec<(i64, String)> =
            sqlx::query_as(&format!("SELECT id, item FROM {} ORDER BY id", self.table))
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, item)| Order { id, item })
            .collect())
    }
}

/// The service: every call goes to the database.
pub(crate) struct OrdersService {
    database: Database,
}

impl OrdersService {
    pub(crate) fn new(database: Database) -> Self {
        Self { database }
    }
}

fn database_error(error: sqlx::Error) -> Status {
    tracing::error!(%error, "the orders database failed");
    Status::unavailable("the orders database is unavailable; retry with the same idempotency-key")
}

impl OrdersService {
    /// Creates an order of `item`: the work of `CreateOrder` and `PlaceOrder`.
    async fn order(&self, item: String) -> Result<Response<Order>, Status> {
        match item.as_str() {
            "unavailable" => {
                return Err(Status::unavailable(
                    "orders are not taken right now; retry later",
                ));
            }
            "invalid" => return Err(Status::invalid_argument("item is invalid")),
            "slow" => tokio::time::sleep(Duration::from_secs(2)).await,
            _ => {}
        }
        let order = self.database.insert(&item).await.map_err(database_error)?;
        tracing::info!(id = order.id, "created an order");
        Ok(Response::new(order))
    }
}

#[tonic::async_trait]
impl pb::orders_server::Orders for OrdersService {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        self.order(request.into_inner().item).await
    }

    /// `CreateOrder` whose key is the message's `request_id` (AIP-155), not metadata.
    async fn place_order(
        &self,
        request: Request<PlaceOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        self.order(request.into_inner().item).await
    }

    type ListOrdersStream = Pin<Box<dyn Stream<Item = Result<Order, Status>> + Send>>;

    async fn list_orders(
        &self,
        _request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        let orders = self.database.all().await.map_err(database_error)?;
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            orders.into_iter().map(Ok),
        ))))
    }
}
