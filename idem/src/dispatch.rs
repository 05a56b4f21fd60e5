//! One consumer, several kinds of event: handlers chosen by the event's type, payloads read into your types.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use idem_ports::{HandlerError, InboundEvent};
use idem_postgres::PgUnitOfWork;
use serde::de::DeserializeOwned;

use crate::PgEventHandler;

/// A handler of one kind of event, given its payload read (JSON) into `Event`; a payload that does not
/// read is malformed (dead-lettered at once, with serde's message as the reason).
#[async_trait]
pub trait TypedEventHandler: Send + Sync {
    /// The payload's type.
    type Event: DeserializeOwned + Send;

    /// Applies one event, as [`PgEventHandler::handle`]; `message` has its id, headers and position.
    async fn handle(
        &self,
        tx: &mut PgUnitOfWork,
        event: Self::Event,
        message: &InboundEvent,
    ) -> Result<(), HandlerError>;
}

/// What [`Dispatch`] does with an event of a type it has no handler for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unhandled {
    /// Record it as processed and do nothing (a topic carrying kinds this consumer does not need).
    #[default]
    Skip,
    /// Dead-letter it as malformed (a topic that should carry nothing else).
    DeadLetter,
}

/// A [`PgEventHandler`] that hands each event to the handler of its type: the `event_type` header idem's
/// relay sends, or else the `type` field of a JSON payload (producers that put it in the body).
///
/// ```no_run
/// # use idem::{Dispatch, HandlerError, InboundEvent, TypedEventHandler, Unhandled};
/// # use idem::postgres::PgUnitOfWork;
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order_id: String }
/// struct Place;
/// #[idem::async_trait]
/// impl TypedEventHandler for Place {
///     type Event = OrderPlaced;
///     async fn handle(&self, tx: &mut PgUnitOfWork, e: OrderPlaced, _: &InboundEvent) -> Result<(), HandlerError> {
///         // your SQL on tx.connection(), with e.order_id
///         Ok(())
///     }
/// }
/// let handler = Dispatch::new().on_typed("OrderPlaced", Place).unhandled(Unhandled::Skip);
/// // idem::pg_runner(settings, store, clock, handler)
/// ```
#[derive(Default)]
pub struct Dispatch {
    routes: HashMap<String, Arc<dyn PgEventHandler>>,
    unhandled: Unhandled,
}

impl std::fmt::Debug for Dispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut types: Vec<&String> = self.routes.keys().collect();
        types.sort();
        f.debug_struct("Dispatch").field("types", &types).field("unhandled", &self.unhandled).finish()
    }
}

impl Dispatch {
    /// No handlers yet; events of other types are skipped.
    pub fn new() -> Self {
        Self::default()
    }

    /// Events of `event_type` go to `handler`, which reads the payload itself.
    pub fn on(mut self, event_type: &str, handler: impl PgEventHandler + 'static) -> Self {
        self.routes.insert(event_type.to_owned(), Arc::new(handler));
        self
    }

    /// Events of `event_type` go to `handler`, given their payload as its `Event`.
    pub fn on_typed<H: TypedEventHandler + 'static>(self, event_type: &str, handler: H) -> Self {
        self.on(event_type, Typed(handler))
    }

    /// What happens to events of other types.
    pub fn unhandled(mut self, unhandled: Unhandled) -> Self {
        self.unhandled = unhandled;
        self
    }
}

/// The type of `event`: its `event_type` header, or the `type` field of its JSON payload.
fn type_of(event: &InboundEvent) -> Option<String> {
    if let Some(t) = event.event_type() {
        return Some(t.to_owned());
    }
    #[derive(serde::Deserialize)]
    struct Typed {
        #[serde(rename = "type")]
        kind: String,
    }
    serde_json::from_slice::<Typed>(&event.payload).ok().map(|t| t.kind)
}

#[async_trait]
impl PgEventHandler for Dispatch {
    async fn handle(&self, tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        let kind = type_of(event);
        match (kind.as_deref().and_then(|k| self.routes.get(k)), self.unhandled) {
            (Some(handler), _) => handler.handle(tx, event).await,
            (None, Unhandled::Skip) => Ok(()),
            (None, Unhandled::DeadLetter) => Err(HandlerError::Malformed(match kind {
                Some(kind) => format!("no handler for events of type {kind:?}"),
                None => "the event has no type (no event_type header, no JSON type field)".to_owned(),
            })),
        }
    }
}

struct Typed<H>(H);

#[async_trait]
impl<H: TypedEventHandler> PgEventHandler for Typed<H> {
    async fn handle(&self, tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        // the reason names the field and the expected type, never a payload value (logs, `dlq.error`)
        let payload: H::Event = idem_domain::json::read(&event.payload)
            .map_err(|why| HandlerError::Malformed(format!("the payload does not read as its type: {why}")))?;
        self.0.handle(tx, payload, event).await
    }
}
