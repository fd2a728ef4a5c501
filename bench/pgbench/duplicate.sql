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
