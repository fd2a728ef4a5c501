-- A first delivery as dedupe-proxy stores it: the claim, then the settle,
-- each its own transaction (autocommit), with the exact statements of
-- src/store/postgres.rs ($1 source, $2 key, $3 payload_sha256, $4 lease in
-- ms; settle: $3 attempt, $4 status, $5 response_status). pgbench numbers
-- every :variable occurrence as its own parameter, so the prepared text has
-- $1..$6 where the proxy's reuses $1 and $2; the plan is the same.
-- Keys: 18 digits, nonce (6) + client (3) + per-client counter (9), the same
-- shape as bench/wrk/webhook.lua's. Variables: -D nonce, n=0, source, sha,
-- lease_ms, attempt, status, response_status.
\set n :n + 1
\set key :nonce * 1000000000000 + :client_id * 1000000000 + :n
WITH prior AS (
                   SELECT status, payload_sha256, received_at FROM processed_events
                    WHERE source = :source AND event_id = :key
                 ), claimed AS (
                   INSERT INTO processed_events AS e (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   VALUES (:source, :key, 'processing', 1, :sha, now() + :lease_ms::bigint * interval '1 millisecond')
                   ON CONFLICT (source, event_id) DO UPDATE
                      SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                          lease_expires_at = excluded.lease_expires_at,
                          response_status = NULL, completed_at = NULL
                    WHERE e.status = 'failed'
                       OR (e.status = 'processing' AND e.lease_expires_at <= now())
                   RETURNING attempts, payload_sha256
                 )
                 SELECT true AS won, c.attempts, c.payload_sha256, p.status,
                        0::float8 AS age_seconds
                   FROM claimed c LEFT JOIN prior p ON true
                 UNION ALL
                 SELECT false, 0, p.payload_sha256, p.status,
                        extract(epoch FROM now() - p.received_at)::float8
                   FROM prior p WHERE NOT EXISTS (SELECT 1 FROM claimed);
UPDATE processed_events
                    SET status = :status, response_status = :response_status, completed_at = now(), lease_expires_at = NULL
                  WHERE source = :source AND event_id = :key AND status = 'processing' AND attempts = :attempt;
