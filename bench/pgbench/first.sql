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
                 ), inserted AS (
                   INSERT INTO processed_events (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   VALUES (:source, :key, 'processing', 1, :sha, now() + :lease_ms * interval '1 millisecond')
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING attempts, payload_sha256
                 ), retaken AS (
                   UPDATE processed_events AS e
                      SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                          lease_expires_at = now() + :lease_ms * interval '1 millisecond',
                          response_status = NULL, completed_at = NULL
                    WHERE e.source = :source AND e.event_id = :key
                      AND (e.status = 'failed'
                           OR (e.status = 'processing' AND e.lease_expires_at <= now()))
                      AND NOT EXISTS (SELECT 1 FROM inserted)
                   RETURNING e.attempts, e.payload_sha256
                 ), claimed AS (
                   SELECT * FROM inserted UNION ALL SELECT * FROM retaken
                 )
                 SELECT 1::int8, c.attempts IS NOT NULL, coalesce(c.attempts, 0),
                        coalesce(c.payload_sha256, p.payload_sha256), p.status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0)
                   FROM (SELECT 1) one
                   LEFT JOIN claimed c ON true
                   LEFT JOIN prior p ON true;
UPDATE processed_events
                    SET status = :status, response_status = :response_status, completed_at = now(), lease_expires_at = NULL
                  WHERE source = :source AND event_id = :key AND status = 'processing' AND attempts = :attempt
                 RETURNING 1::int8;
