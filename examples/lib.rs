//! Examples of embedding the Deltafin API.
