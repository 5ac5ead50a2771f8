//! Sans-IO RDS protocol engine.
