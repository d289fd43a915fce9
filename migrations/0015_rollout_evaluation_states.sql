-- Rollouts gated on quality: a rollout that names an evaluation set is
-- `evaluating` until the candidate and the stable version have been scored
-- on it, and ends `rejected` when the candidate scores too low. (New enum
-- values are usable only once committed, so the tables that use them come
-- in the next migration.)

ALTER TYPE rollout_state ADD VALUE 'evaluating' BEFORE 'running';
ALTER TYPE rollout_state ADD VALUE 'rejected';
