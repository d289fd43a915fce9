-- The worker's forward-pass time each request used, in microseconds:
-- its share of every engine step it ran in (each step's wall time split
-- among the step's sequences by the tokens each fed it). NULL where no
-- choice finished on a worker (refusals, cancellations, rows from before).
ALTER TABLE audit_log ADD COLUMN device_us bigint;
