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
///
/// The default dead-letters it: a consumer deployed after its producer started sending a new kind, or one
/// whose handler was never registered, keeps those events in the dead-letter topic to redrive once the
/// handler is there (`idem dlq redrive`). `Skip` records them as processed — they are never seen again —
/// and is for topics that carry kinds this consumer will never need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unhandled {
    /// Record it as processed and do nothing: the event is gone for this consumer group, for good.
    Skip,
    /// Dead-letter it as malformed (the reason names its type), to be redriven once a handler exists.
    #[default]
    DeadLetter,
}

/// A [`PgEventHandler`] that hands each event to the handler of its type: the `event_type` header idem's
/// relay sends, or else — when there is no header or no handler for it — the `type` field of a JSON
/// payload (producers that put it in the body, or wrap it). An event no handler takes is dead-lettered
/// unless [`unhandled`](Dispatch::unhandled) says otherwise.
///
/// ```no_run
/// # use idem::{Dispatch, HandlerError, InboundEvent, TypedEventHandler};
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
/// let handler = Dispatch::new().on_typed("OrderPlaced", Place); // other types: dead-lettered
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
    /// No handlers yet; events of other types are dead-lettered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Events of `event_type` go to `handler`, which reads the payload itself.
    ///
    /// # Panics
    /// If `event_type` has a handler already: two registrations of one type are a wiring mistake, and
    /// keeping either would silently drop the other's effects (as axum's `Router::route` panics on a
    /// route given twice).
    pub fn on(mut self, event_type: &str, handler: impl PgEventHandler + 'static) -> Self {
        let replaced = self.routes.insert(event_type.to_owned(), Arc::new(handler));
        assert!(replaced.is_none(), "Dispatch::on: events of type {event_type:?} have a handler already");
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

/// The `type` field of `event`'s JSON payload.
fn type_in_payload(event: &InboundEvent) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Typed {
        #[serde(rename = "type")]
        kind: String,
    }
    serde_json::from_slice::<Typed>(&event.payload).ok().map(|t| t.kind)
}

impl Dispatch {
    /// The handler of `event`'s type — its header's, else its payload's — or the types it was looked up by.
    fn route(&self, event: &InboundEvent) -> Result<&Arc<dyn PgEventHandler>, Vec<String>> {
        let header = event.event_type().map(str::to_owned);
        if let Some(handler) = header.as_deref().and_then(|t| self.routes.get(t)) {
            return Ok(handler);
        }
        let body = type_in_payload(event);
        if let Some(handler) = body.as_deref().and_then(|t| self.routes.get(t)) {
            return Ok(handler);
        }
        Err(header.into_iter().chain(body).collect())
    }
}

#[async_trait]
impl PgEventHandler for Dispatch {
    async fn handle(&self, tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        match (self.route(event), self.unhandled) {
            (Ok(handler), _) => handler.handle(tx, event).await,
            (Err(_), Unhandled::Skip) => Ok(()),
            (Err(types), Unhandled::DeadLetter) if types.is_empty() => Err(HandlerError::Malformed(
                "the event has no type (no event_type header, no JSON type field)".to_owned(),
            )),
            (Err(types), Unhandled::DeadLetter) => {
                Err(HandlerError::Malformed(format!("no handler for events of type {}", types.join(" or "))))
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    #[async_trait]
    impl PgEventHandler for Nothing {
        async fn handle(&self, _: &mut PgUnitOfWork, _: &InboundEvent) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    fn event(event_type: Option<&str>, payload: &str) -> InboundEvent {
        let headers = event_type.map(|t| ("event_type".to_owned(), t.as_bytes().to_vec())).into_iter().collect();
        InboundEvent {
            event_id: uuid::Uuid::from_u128(1),
            saga_id: None,
            topic: "t".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: payload.as_bytes().to_vec(),
            headers,
        }
    }

    #[test]
    #[should_panic(expected = "have a handler already")]
    fn a_type_registered_twice_is_refused() {
        let _ = Dispatch::new().on("Credited", Nothing).on("Credited", Nothing);
    }

    /// A header naming a type with no handler falls back to the payload's `type`; an event neither names
    /// is dead-lettered by default, with both names in the reason.
    #[test]
    fn the_payload_type_is_tried_when_the_header_has_no_handler() {
        let d = Dispatch::new().on("Credited", Nothing);
        assert_eq!(d.unhandled, Unhandled::DeadLetter, "the default");
        assert!(d.route(&event(Some("Envelope"), r#"{"type": "Credited"}"#)).is_ok());
        assert!(d.route(&event(None, r#"{"type": "Credited"}"#)).is_ok());
        assert!(d.route(&event(Some("Credited"), "{}")).is_ok());
        let missed = d.route(&event(Some("Envelope"), r#"{"type": "Debited"}"#)).err();
        assert_eq!(missed, Some(vec!["Envelope".to_owned(), "Debited".to_owned()]));
    }
}
