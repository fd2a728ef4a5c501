-- A duplicate as dedupe-proxy stores it: the claim statement alone, on a key
-- that is already `done` (it returns the losing row; nothing is settled).
-- Same statement as src/store/postgres.rs and first.sql. Keys: one of the
-- `keys` pre-populated 18-digit keys, nonce (6) + 999 + index (9), as in
-- bench/wrk/webhook.lua's cycle mode. Variables: -D nonce, keys, source,
-- sha, lease_ms.
\set i random(0, :keys - 1)
\set key :nonce * 1000000000000 + 999 * 1000000000 + :i
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
